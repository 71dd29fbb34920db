"""The gated delta rule of Qwen3.5's Gated DeltaNet layers (engine/models/gated_deltanet.py), in PyTorch
float32 (the reference path; no C++ or Triton kernel yet). Math as transformers' torch_chunk_gated_delta_rule
and torch_recurrent_gated_delta_rule, op for op, so float32 results match.

Per value head, a state S [k_dim, v_dim]; per token t (q_t, k_t L2-normed, q_t scaled by k_dim^-0.5):

    S <- exp(g_t) S                        (g_t <= 0: the decay, in log space)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T (the delta rule: write the part of v_t that S does not predict)
    o_t = S^T q_t

prefill_scan runs a sequence's chunk of tokens 64 at a time (the chunkwise form: a unit-triangular solve
per chunk, then one state update per chunk), from any state: a prompt cut anywhere carries S across the cut
and gives the same state and outputs as one pass, up to float rounding. decode_step runs one token for a
batch of sequences. Shapes: Hv value heads (the query / key heads repeated to Hv), K = k_dim, V = v_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk_size (and FLA's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' l2norm, as FLA computes it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """Token-major inputs q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv] -> the same in float32 with the
    query / key heads repeated to Hv (each serves Hv / Hk consecutive value heads) and L2-normed (q not
    yet scaled: the scan and the step scale it each their way, as transformers does)."""
    rep = v.shape[1] // k.shape[1]
    if rep != 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    return l2norm(q), l2norm(k), v, g, beta


def prefill_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence's n tokens from `state` [Hv, K, V] (float32, from prepare): q, k [n, Hv, K], v [n, Hv, V],
    g, beta [n, Hv] -> (outputs [n, Hv, V], the state after the last token [Hv, K, V]), both float32."""
    n = q.shape[0]
    q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # [Hv, n, *]
    g, beta = g.t().contiguous(), beta.t().contiguous()  # [Hv, n]
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - n % chunk) % chunk  # zero tokens after the last: beta 0 writes nothing, g 0 decays nothing
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    heads, chunks = q.shape[0], (n + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, chunks, chunk).cumsum(dim=-1)  # [Hv, chunks, chunk]: log decay since the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay between positions j <= i of a chunk: exp(cum_i - cum_j); 0 above the diagonal
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [Hv, c, chunk, chunk]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # the chunk's delta-rule updates as one unit-triangular system
    intra = (q @ k.transpose(-1, -2)) * pair  # within-chunk attention
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)  # reads the state decayed to its position
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decayed to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, chunks, 1, 1]
    out = torch.zeros_like(new_values)  # [Hv, chunks, chunk, V]
    s = state.to(new_values)
    for i in range(chunks):
        v_new = new_values[:, i] - k_cum[:, i] @ s  # what the state does not predict yet
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, out.shape[-1])[:, :n]  # [Hv, n, V]
    return out.transpose(0, 1), s


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of each of B sequences (float32, from prepare): q, k [B, Hv, K], v [B, Hv, V], g, beta
    [B, Hv], their states [B, Hv, K, V] -> (outputs [B, Hv, V], the new states [B, Hv, K, V])."""
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v) * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, V]: what the state predicts for k
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2), s
