"""Qwen3.5's Gated DeltaNet linear-attention layer over the state cache (engine/state/), in PyTorch (the
reference path; no C++ or Triton kernel yet). Math as transformers' Qwen3_5GatedDeltaNet.

Per token row h [hidden]: one fused in_proj (the checkpoint's in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a) gives the q/k/v channels [2 Hk K + Hv V], the output gate z [Hv V], b and a [Hv]. Then

- a causal depthwise conv (linear_conv_kernel_dim taps, no bias) over the q/k/v channels, then silu; a
  sequence's last taps - 1 columns are its conv window, kept in its state slot (conv_cache.py) between
  steps, so a prompt chunk cut anywhere carries it across the cut; a chunk at position 0 reads zeros
  (transformers' left padding, and how a preempted request rebuilds its state: recompute);
- beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (log decay, <= 0);
- the gated delta rule (engine/models/delta_rule.py) from the sequence's recurrent state [Hv, K, V] in
  its slot (delta_cache.py): a prompt chunk by the chunked scan, a decode by the recurrent step (every
  row a decode: one batched step over the slots, one gather and one scatter);
- the gated norm per value head: rmsnorm(o) * weight * silu(z), then out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.delta_rule import decode_step, prefill_scan, prepare
from engine.models.layers import ForwardContext
from engine.models.short_conv import DepthwiseConvWeights
from engine.state.batch import StateBatch


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * silu(gate) over each head's V values (transformers' Qwen3_5RMSNormGated: the
    norm in float32, cast, scaled; the gate's silu in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, state_index: int) -> None:
        """state_index: this layer's row of the conv-state and delta-state tensors (among DeltaNet layers)."""
        super().__init__()
        self.k_heads, self.v_heads = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
        self.k_dim, self.v_dim = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
        key_size, value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.channels = 2 * key_size + value_size  # the conv's: q, k, v side by side
        self.qkv_split = [key_size, key_size, value_size]
        self.split = [self.channels, value_size, self.v_heads, self.v_heads]  # in_proj's shards: qkv, z, b, a
        taps = int(cfg.linear_conv_kernel_dim)
        self.width = taps - 1  # conv columns kept per sequence
        self.state_index = state_index
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.conv1d = DepthwiseConvWeights(self.channels, taps, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, float(cfg.rms_norm_eps))
        self.out_proj = nn.Linear(value_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, hidden] (the step's rows, sequences packed one after another) -> [T, hidden]."""
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        mixed = F.silu(self._conv(qkv.t(), ctx.state)).t()  # [T, channels]
        q, k, v = mixed.split(self.qkv_split, dim=-1)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv], float32
        q, k, v, g, beta = prepare(q.reshape(t, self.k_heads, self.k_dim), k.reshape(t, self.k_heads, self.k_dim),
                                   v.reshape(t, self.v_heads, self.v_dim), g, beta)  # fmt: skip
        o = self._delta(q, k, v, g, beta, ctx.state).to(x.dtype)  # [T, Hv, V]
        y = self.norm(o.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim)).reshape(t, -1)
        return self.out_proj(y)

    # ---- the causal conv over the conv windows ---------------------------------------------------------
    def _conv(self, cols: torch.Tensor, state: StateBatch | None) -> torch.Tensor:
        """cols: [channels, T] -> the conv [channels, T] (before silu); reads and writes the windows."""
        weight = self.conv1d.weight  # [channels, 1, taps]
        if state is None:  # no state cache (a profiling pass): the whole batch as one fresh sequence
            return _window_conv(cols.new_zeros(self.channels, self.width), cols, weight)[0]
        windows = state.conv[self.state_index]  # [slots, channels, width]
        if state.all_decode:  # every row a decode on its own slot: one batched conv
            assert state.slot_index is not None
            old = windows.index_select(0, state.slot_index)  # [B, channels, width]
            xs = torch.cat([old, cols.t().unsqueeze(-1).to(old.dtype)], dim=-1)  # [B, channels, taps]
            windows.index_copy_(0, state.slot_index, xs[:, :, 1:])
            return F.conv1d(xs.to(weight.dtype), weight, None, groups=self.channels)[:, :, 0].t()
        outs = []
        for at, n, slot, fresh in zip(state.offsets, state.lengths, state.slots, state.fresh, strict=True):
            seg = cols[:, at : at + n]  # [channels, n]
            window = seg.new_zeros(self.channels, self.width) if fresh else windows[slot]
            out, new_window = _window_conv(window, seg, weight)
            windows[slot].copy_(new_window)
            outs.append(out)
        return torch.cat(outs, dim=-1)

    # ---- the delta rule over the recurrent states -------------------------------------------------------
    def _delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: StateBatch | None) -> torch.Tensor:  # fmt: skip
        """Token-major float32 q, k [T, Hv, K], v [T, Hv, V], g, beta [T, Hv] -> outputs [T, Hv, V] float32."""
        if state is None:  # a profiling pass: one fresh sequence
            return prefill_scan(q, k, v, g, beta, self._zeros(q))[0]
        assert state.delta is not None, "a DeltaNet layer needs the delta-state tensor (engine/state/delta_cache.py)"
        states = state.delta[self.state_index]  # [slots, Hv, K, V]
        if state.all_decode:
            assert state.slot_index is not None
            out, new = decode_step(q, k, v, g, beta, states.index_select(0, state.slot_index))
            states.index_copy_(0, state.slot_index, new)
            return out
        outs = []
        for at, n, slot, fresh in zip(state.offsets, state.lengths, state.slots, state.fresh, strict=True):
            rows = slice(at, at + n)
            start = self._zeros(q) if fresh else states[slot]
            if n == 1 and not fresh:  # a decode beside prompt chunks: the recurrent step, as transformers
                out, new = decode_step(q[rows], k[rows], v[rows], g[rows], beta[rows], start.unsqueeze(0))
                new = new[0]
            else:
                out, new = prefill_scan(q[rows], k[rows], v[rows], g[rows], beta[rows], start)
            states[slot].copy_(new)
            outs.append(out)
        return torch.cat(outs, dim=0)

    def _zeros(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(self.v_heads, self.k_dim, self.v_dim)


def _window_conv(window: torch.Tensor, seg: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv of one sequence's new columns seg [channels, n] after its window
    [channels, width]: (output [channels, n], the new window: the last `width` columns of both together)."""
    xs = torch.cat([window.to(seg.dtype), seg], dim=-1)  # [channels, width + n]
    out = F.conv1d(xs.unsqueeze(0).to(weight.dtype), weight, None, groups=seg.shape[0])[0]  # [channels, n]
    return out, xs[:, xs.shape[1] - window.shape[1] :]
