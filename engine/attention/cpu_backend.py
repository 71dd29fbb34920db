"""CPU attention with this repository's C++ decode kernels (engine/kernels/csrc/cpu_attention.cpp).

Decode attention reads the paged cache in place: one kernel computes, per (sequence, KV head), the
scores q k^T straight from the cache blocks, their softmax, and the sum p v from the V blocks. The
reference backend instead copies every decode's context out of the cache in every layer before its
batched matmuls; on CPU that copy is as costly as the matmuls themselves.

Cache layout: the same allocation as the reference, [kv_heads, num_blocks * block_size, head_dim]
per layer, but each K block is stored dimension-major, i.e. K is used as
[kv_heads, num_blocks, head_dim, block_size], so the scores kernel multiplies a query element by a
run of block_size contiguous keys (vertical SIMD, no horizontal sums). V stays token-major. Prefill
(and chunked prefill over cached context) runs the reference's scaled_dot_product_attention on the
context gathered back into [kv_heads, ctx, head_dim].
"""

from __future__ import annotations

import torch

from engine.attention.torch_ref import TorchAttentionBackend, TorchMetadata, _Prefill


def _k_blocks(k_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The K cache as [kv_heads, num_blocks, head_dim, block_size] (a view)."""
    kvh, slots, d = k_cache.shape
    return k_cache.view(kvh, slots // block_size, d, block_size)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def _store(self, k, v, k_cache, v_cache, meta: TorchMetadata) -> None:
        # k, v: [T, kv_heads, d]. V rows to their slots; K values to column (slot % bs) of their
        # dimension-major block. Slot -1 stores nothing.
        torch.ops.tokenmill.paged_store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.block_size)

    def _context_kv(self, k_cache, v_cache, p: _Prefill, block_size: int,
                    lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [lo, ctx): whole blocks from the one holding lo, then the range cut out of them
        ctx, first = p.gather.shape[0], lo // block_size
        kb = _k_blocks(k_cache, block_size).index_select(1, p.blocks[first:])  # [kvh, n, d, bs]
        start = lo - first * block_size
        kk = kb.transpose(2, 3).reshape(kb.shape[0], -1, kb.shape[2])[:, start : start + ctx - lo]  # [kvh, ctx - lo, d]
        return kk, v_cache.index_select(1, p.gather[lo:])

    def _decode(self, q, k_cache, v_cache, meta: TorchMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        nd = q.shape[0]
        tables = meta.decode_gather.view(nd, -1)  # [nd, width] block ids (padding: block 0, never read)
        # Scores, softmax and values per (sequence, KV head) in one kernel (one parallel region a layer);
        # window 0 and softcap 0.0 mean none. The kernel reads only the window's blocks; sinks (GPT-OSS)
        # join each head's softmax denominator there.
        if sinks is not None:
            return torch.ops.tokenmill.paged_decode_attention_sinks(
                q, k_cache, v_cache, tables, meta.decode_lens, meta.block_size, meta.decode_ctx, scale,
                window or 0, softcap or 0.0, sinks,
            )  # [nd, heads, d] in the cache's dtype
        return torch.ops.tokenmill.paged_decode_attention(
            q, k_cache, v_cache, tables, meta.decode_lens, meta.block_size, meta.decode_ctx, scale,
            window or 0, softcap or 0.0,
        )  # [nd, heads, d] in the cache's dtype
