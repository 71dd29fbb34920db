"""Reference attention in plain PyTorch (CPU and CUDA): gather the slots in use, then attend.

Cache layout, per layer: [num_kv_heads, num_blocks * block_size, head_dim] (head-major), so a
gather of a sequence's slots gives [kv_heads, ctx, head_dim] that feeds batched matmuls without
re-layout copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchLayout


@dataclass
class _Prefill:
    q_start: int  # offset of its first query token in the packed batch
    q_len: int
    gather: torch.Tensor  # [context_len] long, cache slots of its whole context
    blocks: torch.Tensor  # [ceil(context_len / block_size)] long, its block ids in order
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when plain causal (no cached prefix)


@dataclass
class TorchMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_tokens] long
    store_all: bool  # no -1 slots: store with one index_copy
    num_decodes: int
    block_size: int
    decode_ctx: int  # padded context length of the decode batch (a multiple of block_size)
    decode_gather: torch.Tensor | None  # [num_decodes * decode_ctx / block_size] block ids, padded with 0
    decode_lens: torch.Tensor | None  # [num_decodes] long, context lengths (this step's token included)
    prefills: list[_Prefill]
    # Built by the reference's first decode layer, reused by the rest (every layer's cache has the
    # same shape); backends that read the cache in place never build them:
    # decode_rows: [kv_heads * len(decode_gather)] rows of the cache viewed [kv_heads * num_blocks,
    # block_size * d]; decode_k/decode_v: the gathered blocks, one workspace for all layers;
    # decode_bias: [num_decodes * kv_heads, 1, decode_ctx] in q's dtype, 0 attend, -inf padding.
    decode_rows: torch.Tensor | None = None
    decode_k: torch.Tensor | None = None
    decode_v: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None


def _slots(block_table: list[int], block_size: int, n: int) -> torch.Tensor:
    """Cache slot of each of the first n positions of a sequence: [n] long."""
    blocks = torch.tensor(block_table, dtype=torch.long)
    pos = torch.arange(n, dtype=torch.long)
    return blocks[pos // block_size] * block_size + pos % block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchMetadata:
        nd, bs = layout.num_decodes, layout.block_size
        decode_gather = decode_lens = None
        max_ctx = 0
        if nd:
            lens = torch.tensor(layout.context_lens[:nd])
            max_blocks = -(-int(lens.max()) // bs)
            max_ctx = max_blocks * bs  # whole blocks are gathered; the tail is masked
            # padded block tables (pad: block 0), built as one tensor (a step may hold hundreds of rows:
            # a prompt chunk packed as one decode per position, engine/models/batch_invariant.py)
            rows = [t[:max_blocks] for t in layout.block_tables[:nd]]
            tables = torch.tensor([r + [0] * (max_blocks - len(r)) for r in rows], dtype=torch.long)
            decode_gather = tables.flatten().to(device)
            decode_lens = lens.to(device)
        prefills, q_start = [], nd
        for i in range(nd, len(layout.query_lens)):
            q, c = layout.query_lens[i], layout.context_lens[i]
            mask = None
            if c != q:  # cached prefix or earlier chunks: causal with an offset
                mask = torch.arange(c)[None, :] <= (c - q + torch.arange(q))[:, None]
                mask = mask.to(device)
            table = layout.block_tables[i][: -(-c // bs)]
            blocks = torch.tensor(table, dtype=torch.long).to(device)
            prefills.append(_Prefill(q_start, q, _slots(table, bs, c).to(device), blocks, mask))
            q_start += q
        slot_mapping = layout.slot_mapping.to(device)
        store_all = bool((layout.slot_mapping >= 0).all())
        return TorchMetadata(
            slot_mapping, store_all, nd, bs, max_ctx, decode_gather, decode_lens, prefills
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta)
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: no packed output to assemble
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        for p in meta.prefills:
            qq = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
            kk, vv = self._context_kv(k_cache, v_cache, p, meta.block_size)  # [kv_heads, ctx, d] each
            kk, vv = kk.unsqueeze(0), vv.unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
            out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
        return out

    # ---- what a backend with another cache layout overrides (cpu_backend.py) ----------------------
    def _decode(self, q, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        return _decode_attention(q, k_cache, v_cache, meta, scale)

    def _context_kv(self, k_cache, v_cache, p: _Prefill, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefilling sequence's whole context: K, V [kv_heads, context_len, d]."""
        return k_cache.index_select(1, p.gather), v_cache.index_select(1, p.gather)

    def _store(self, k, v, k_cache, v_cache, meta: TorchMetadata) -> None:
        # k, v: [T, kv_heads, d] -> cache [kv_heads, slots, d]
        if meta.store_all:
            k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
            return
        keep = meta.slot_mapping >= 0
        k_cache[:, meta.slot_mapping[keep]] = k[keep].transpose(0, 1)
        v_cache[:, meta.slot_mapping[keep]] = v[keep].transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
    """One query per sequence; batched matmuls per (sequence, KV head), GQA without repeating K/V.
    Much cheaper on CPU than the flash kernel for a single query row."""
    nd, h, d = q.shape
    kvh, ctx, bs = k_cache.shape[0], meta.decode_ctx, meta.block_size
    if meta.decode_rows is None:
        # Row (head, block) of the cache viewed [kv_heads * num_blocks, bs * d], ordered (sequence,
        # head, block): one dim-0 gather of whole blocks (bs * d contiguous elements each) lands K
        # as [nd * kv_heads, ctx, d], the layout of q viewed [nd * kv_heads, group, d]: no transposes.
        num_blocks = k_cache.shape[1] // bs
        blocks = meta.decode_gather.view(nd, 1, -1)
        heads = torch.arange(kvh, device=q.device).view(1, kvh, 1) * num_blocks
        meta.decode_rows = (heads + blocks).flatten()
        # Written into the same two buffers by every layer: no per-layer allocation of the big
        # gathered tensors (on CPU a fresh multi-megabyte allocation can cost more than the copy).
        meta.decode_k = k_cache.new_empty(meta.decode_rows.shape[0], bs * d)
        meta.decode_v = v_cache.new_empty(meta.decode_rows.shape[0], bs * d)
        pad = torch.arange(ctx, device=q.device)[None, :] >= meta.decode_lens[:, None]  # [nd, ctx]
        bias = torch.zeros(nd, 1, ctx, dtype=q.dtype, device=q.device).masked_fill_(pad[:, None], float("-inf"))
        meta.decode_bias = bias.repeat_interleave(kvh, dim=0)  # [nd * kvh, 1, ctx]
    kk = torch.index_select(k_cache.view(-1, bs * d), 0, meta.decode_rows, out=meta.decode_k).view(-1, ctx, d)
    vv = torch.index_select(v_cache.view(-1, bs * d), 0, meta.decode_rows, out=meta.decode_v).view(-1, ctx, d)
    qq = q.reshape(nd * kvh, h // kvh, d)  # [nd * kvh, group, d] (a copy when q is a view into qkv)
    # scale * q k^T + bias (0 or -inf: exact whatever the rounding), then softmax over the context.
    scores = torch.baddbmm(meta.decode_bias, qq, kk.transpose(1, 2), alpha=scale)  # [nd * kvh, group, ctx]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, vv).view(nd, h, d)
