"""Mamba2's selective scan (state space duality, SSD) in PyTorch: the chunked form for prompt chunks and
the recurrent step for decodes (the reference path; no C++ or Triton kernel yet).

Per head h the recurrence over a sequence's tokens t is, with dt_t = softplus(dt_raw_t + dt_bias) and
a = -exp(A_log):

    S_t = exp(dt_t a) S_{t-1} + dt_t x_t B_t^T       S: [head_dim, d_state], x_t [head_dim], B_t [d_state]
    y_t = S_t C_t + D x_t

B and C are shared by the heads of a group (n_groups). `chunk_scan` computes it for a whole chunk of a
sequence at once (quadratic inside blocks of `block` tokens, the recurrence between blocks) starting from
any state, and returns the state after the last token: a prompt cut into chunks anywhere carries the
state across each cut. `step` is one token per sequence for a batch of decodes, updating the states in
place. Both are transformers' arithmetic (GraniteMoeHybrid's torch fallback: mamba2_chunk_scan and
mamba2_selective_state_update): a prompt computed whole starting at position 0 gives transformers'
bits; a prompt cut elsewhere than at block boundaries sums in another order (float rounding only).

Shapes: L = the chunk's tokens, H = heads, P = head_dim, N = d_state, G = n_groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               d: torch.Tensor, dt_bias: torch.Tensor, block: int,
               initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence's chunk: x [L, H, P], dt [L, H] (before dt_bias and softplus), a [H] float32
    (-exp(A_log)), b / c [L, G, N], d / dt_bias [H], initial [H, P, N] float32 or None (zeros: the
    sequence starts here) -> (y [L, H, P] float32, D skip included; the state after the chunk [H, P, N]
    float32)."""
    length, heads, head_dim = x.shape
    dt = F.softplus(dt + dt_bias.to(dt.dtype))  # [L, H]; the (0, inf) dt limit clamps nothing
    x = x.float()
    b = b.float().repeat_interleave(heads // b.shape[1], dim=1, output_size=heads)  # [L, H, N]
    c = c.float().repeat_interleave(heads // c.shape[1], dim=1, output_size=heads)
    pad = (block - length % block) % block
    skip = d[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))  # [L + pad, H, P]: the D skip connection
    x = x * dt[..., None].float()  # discretised input
    da = a.to(x.dtype) * dt.float()  # [L, H]: log of each token's decay
    # blocks of `block` tokens: [K, l, ...] (K blocks; the last zero-padded)
    x, da, b, c = (_blocks(t, pad, block) for t in (x, da, b, c))
    da = da.permute(2, 0, 1)  # [H, K, l]
    da_cum = torch.cumsum(da, dim=-1)
    # 1. inside each block: attention-like weights C_l . B_s times the decay from s to l
    decay = torch.exp(_segment_sum(da))  # [H, K, l, s]
    scores = torch.einsum("clhn,cshn->clsh", c, b) * decay.permute(1, 2, 3, 0)  # [K, l, s, H]
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)  # [K, l, H, P]
    # 2. each block's own contribution to the state at its end
    decay_to_end = torch.exp(da_cum[:, :, -1:] - da_cum)  # [H, K, l]
    states = torch.einsum("clhn,clhp->chpn", b * decay_to_end.permute(1, 2, 0)[..., None], x)  # [K, H, P, N]
    # 3. the state entering each block: the recurrence between blocks, from `initial`
    first = initial[None].to(states.dtype) if initial is not None else torch.zeros_like(states[:1])
    states = torch.cat([first, states], dim=0)  # [K + 1, H, P, N]
    block_decay = torch.exp(_segment_sum(F.pad(da_cum[:, :, -1], (1, 0))))  # [H, to, from]
    entering = torch.einsum("zch,zhpn->chpn", block_decay.permute(2, 1, 0), states)  # [K + 1, H, P, N]
    states, final = entering[:-1], entering[-1]
    # 4. the entering state read out at each position of its block
    y_off = torch.einsum("clhn,chpn->clhp", c, states) * torch.exp(da_cum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, heads, head_dim) + skip  # [L + pad, H, P]
    return y[:length], final


def step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         c: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token of each of S sequences: state [S, H, P, N] (updated in place), x [S, H, P], dt [S, H],
    a [H] float32, b / c [S, G, N], d / dt_bias [H] -> y [S, H, P] in x's dtype, D skip included."""
    seqs, heads, head_dim = x.shape
    groups, size = b.shape[1], b.shape[2]
    # per (head, head_dim) as transformers expands them for its kernel's signature
    dt = dt[:, :, None].expand(-1, -1, head_dim) + dt_bias[:, None].expand(-1, head_dim).to(dt.dtype)
    dt = F.softplus(dt)[..., None]  # [S, H, P, 1]
    da = torch.exp(dt.float() * a[:, None, None].expand(-1, head_dim, size).float())  # [S, H, P, N]
    b = b.reshape(seqs, groups, 1, size).expand(seqs, groups, heads // groups, size).reshape(seqs, heads, 1, size)
    dbx = dt * b * x[..., None]  # [S, H, P, N]
    new = state * da + dbx
    state.copy_(new.to(state.dtype))
    c = c.reshape(seqs, groups, 1, size).expand(seqs, groups, heads // groups, size).reshape(seqs * heads, size, 1)
    y = torch.bmm(new.to(c.dtype).view(seqs * heads, head_dim, size), c).view(seqs, heads, head_dim)
    y = y + x * d[:, None].expand(-1, head_dim)
    return y.to(x.dtype)


def _blocks(t: torch.Tensor, pad: int, block: int) -> torch.Tensor:
    """[L, ...] zero-padded to a multiple of `block` tokens -> [K, block, ...]."""
    t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
    return t.reshape(-1, block, *t.shape[1:])


def _segment_sum(t: torch.Tensor) -> torch.Tensor:
    """t [..., n] -> [..., n, n]: out[i, j] = sum(t[j+1 .. i]) for j <= i, -inf above the diagonal (so
    exp() of it is the decay from position j to i, zero where j > i)."""
    n = t.shape[-1]
    t = t[..., None].expand(*t.shape, n)
    below = torch.tril(torch.ones(n, n, device=t.device, dtype=torch.bool), diagonal=-1)
    sums = torch.cumsum(t.masked_fill(~below, 0), dim=-2)
    return sums.masked_fill(~torch.tril(torch.ones(n, n, device=t.device, dtype=torch.bool)), -torch.inf)
