"""Granite 4's Mamba2 mixer over the state cache (engine/state/), in PyTorch (the reference path; no C++ or
Triton kernel yet). transformers' GraniteMoeHybridMambaLayer, its torch fallback's arithmetic.

Per token row h [hidden]: in_proj(h) -> gate z [I], xBC [I + 2 G N], dt [H]; a depthwise causal conv1d of
`mamba_d_conv` taps (with bias) over the sequence's xBC columns, then silu; xBC -> x [H, P], B, C [G, N];
the selective scan (engine/models/ssd.py) -> y [H, P] with the D skip; a gated RMSNorm per group,
norm(y * silu(z)), and out_proj.

A sequence keeps two things in its state slot (shared index): the conv window, its last d_conv - 1 xBC
columns (engine/state/conv_cache.py), and per head the scan's matrix [P, N] (engine/state/ssm_cache.py).
A chunk starting at position 0 reads zeros instead of its slot (a new request, or a preempted one
computed again); any later chunk (a prompt cut anywhere) and every decode reads what the previous one
left. A prompt chunk runs the chunked scan, a decode the recurrent step; a step of decodes only gathers
the slots, runs them as one batch and scatters them back.

Shapes: T = the step's rows, I = mamba_expand * hidden (= H P), H = mamba_n_heads, P = mamba_d_head,
G = mamba_n_groups, N = mamba_d_state, C = conv channels (I + 2 G N), W = d_conv - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import ssd
from engine.models.layers import ForwardContext
from engine.models.short_conv import DepthwiseConvWeights
from engine.state.batch import StateBatch


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group` channels, in float32, then the weight (transformers'
    GraniteMoeHybridRMSNormGated)."""

    def __init__(self, size: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group, self.eps = group, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: [T, I] -> [T, I] in y's dtype (the weight's where it is wider)."""
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group)  # [T, G, I / G]
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg, state_index: int) -> None:
        """state_index: this layer's row of the conv- and SSM-state tensors (its rank among Mamba2 layers)."""
        super().__init__()
        hidden = int(cfg.hidden_size)
        self.heads, self.head_dim = int(cfg.mamba_n_heads), int(cfg.mamba_d_head)
        self.groups, self.state_size = int(cfg.mamba_n_groups), int(cfg.mamba_d_state)
        self.inner = int(cfg.mamba_expand * hidden)
        self.channels = self.inner + 2 * self.groups * self.state_size
        self.width = int(cfg.mamba_d_conv) - 1  # conv columns kept per sequence
        self.block = int(cfg.mamba_chunk_size)  # the chunked scan's block (transformers' chunk_size)
        self.state_index = state_index
        bias = bool(cfg.mamba_proj_bias)
        self.in_proj = nn.Linear(hidden, self.inner + self.channels + self.heads, bias=bias)
        self.conv1d = DepthwiseConvWeights(self.channels, self.width + 1, bool(cfg.mamba_conv_bias))
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, float(cfg.rms_norm_eps))
        self.out_proj = nn.Linear(self.inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, hidden] (the step's rows, sequences packed one after another) -> [T, hidden]."""
        z, xbc, dt = self.in_proj(x).split([self.inner, self.channels, self.heads], dim=-1)
        state = ctx.state
        if state is not None and state.all_decode:
            y = self._decodes(xbc, dt, state)  # [T, I] in x's dtype
        else:
            y = self._sequences(xbc, dt, state)  # [T, I] float32
        return self.out_proj(self.norm(y, z).to(x.dtype))

    def _decodes(self, xbc: torch.Tensor, dt: torch.Tensor, state: StateBatch) -> torch.Tensor:
        """Every row a decode on its own slot: one gather, one conv, one scan step, one scatter."""
        assert state.slot_index is not None and state.ssm is not None
        conv_state = state.conv[self.state_index]  # [slots, C, W]
        window = conv_state.index_select(0, state.slot_index)  # [S, C, W]
        xs = torch.cat([window, xbc.unsqueeze(-1).to(window.dtype)], dim=-1)  # [S, C, W + 1]
        conv_state.index_copy_(0, state.slot_index, xs[:, :, 1:])
        out = self._conv(xs, xbc.dtype)[:, :, 0]  # [S, C]
        ssm_state = state.ssm[self.state_index]  # [slots, H, P, N]
        s = ssm_state.index_select(0, state.slot_index)  # [S, H, P, N]
        y = self._step(s, out, dt)  # [S, H, P]
        ssm_state.index_copy_(0, state.slot_index, s)
        return y.reshape(y.shape[0], -1)

    def _sequences(self, xbc: torch.Tensor, dt: torch.Tensor, state: StateBatch | None) -> torch.Tensor:
        """Each sequence's rows on their own: a prompt chunk by the chunked scan, a decode by the step."""
        if state is None:  # no state cache (a profiling pass): the whole batch as one fresh sequence
            xs = torch.cat([xbc.new_zeros(self.channels, self.width), xbc.t()], dim=-1)  # [C, W + T]
            return self._scan(self._conv(xs[None], xbc.dtype)[0].t(), dt, None)[0]
        assert state.ssm is not None
        conv_state, ssm_state = state.conv[self.state_index], state.ssm[self.state_index]  # [slots, ...]
        outs = []
        for at, n, slot, fresh in zip(state.offsets, state.lengths, state.slots, state.fresh, strict=True):
            seg, seg_dt = xbc[at : at + n], dt[at : at + n]  # [n, C], [n, H]
            window = conv_state.new_zeros(self.channels, self.width) if fresh else conv_state[slot]  # [C, W]
            xs = torch.cat([window, seg.t().to(window.dtype)], dim=-1)  # [C, W + n]
            conv_state[slot].copy_(xs[:, -self.width :])
            out = self._conv(xs[None], seg.dtype)[0].t()  # [n, C]
            if n == 1 and not fresh:  # a decode beside prompt chunks: the step, as transformers decodes
                y = self._step(ssm_state[slot : slot + 1], out, seg_dt).reshape(1, -1).float()
            else:
                y, final = self._scan(out, seg_dt, None if fresh else ssm_state[slot])
                ssm_state[slot].copy_(final)
            outs.append(y)
        return torch.cat(outs, dim=0)

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor,
              initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The chunked scan of one sequence's n rows after the conv: xbc [n, C], dt [n, H], initial
        [H, P, N] (None: zeros) -> (y [n, I] float32, the state after them [H, P, N] float32)."""
        n = xbc.shape[0]
        x, b, c = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        y, final = ssd.chunk_scan(x.reshape(n, self.heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
                                  b.reshape(n, self.groups, -1), c.reshape(n, self.groups, -1), self.D,
                                  self.dt_bias, self.block, initial)  # fmt: skip
        return y.reshape(n, -1), final

    def _conv(self, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The causal depthwise conv of xs [S, C, W + n] (window first) -> silu of its n outputs [S, C, n]
        in `dtype` (transformers' causal_conv1d_update / causal_conv1d_fn)."""
        w = self.conv1d.weight  # [C, 1, W + 1]
        out = F.conv1d(xs.to(w.dtype), w, self.conv1d.bias, groups=self.channels)
        return F.silu(out).to(dtype)

    def _step(self, s: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One scan step of S sequences: s [S, H, P, N] (updated), xbc [S, C] after the conv, dt [S, H]."""
        x, b, c = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        seqs = x.shape[0]
        return ssd.step(s, x.reshape(seqs, self.heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
                        b.reshape(seqs, self.groups, -1), c.reshape(seqs, self.groups, -1), self.D, self.dt_bias)
