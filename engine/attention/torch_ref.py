"""Reference attention in plain PyTorch (CPU and CUDA): gather the blocks in use, then SDPA."""

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
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when plain causal (no cached prefix)


@dataclass
class TorchMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_tokens] long
    store_all: bool  # no -1 slots: store with one index_copy
    num_decodes: int
    decode_gather: torch.Tensor | None  # [num_decodes, max_ctx] long, padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool, True = attend
    prefills: list[_Prefill]


def _slots(block_table: list[int], block_size: int, n: int) -> torch.Tensor:
    """Cache slot of each of the first n positions of a sequence: [n] long."""
    blocks = torch.tensor(block_table, dtype=torch.long)
    pos = torch.arange(n, dtype=torch.long)
    return blocks[pos // block_size] * block_size + pos % block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchMetadata:
        nd, bs = layout.num_decodes, layout.block_size
        decode_gather = decode_mask = None
        if nd:
            max_ctx = max(layout.context_lens[:nd])
            gather = torch.zeros(nd, max_ctx, dtype=torch.long)
            for i in range(nd):
                c = layout.context_lens[i]
                gather[i, :c] = _slots(layout.block_tables[i], bs, c)
            lens = torch.tensor(layout.context_lens[:nd])
            mask = torch.arange(max_ctx)[None, :] < lens[:, None]
            decode_gather = gather.to(device)
            decode_mask = mask[:, None, None, :].to(device)
        prefills, q_start = [], nd
        for i in range(nd, len(layout.query_lens)):
            q, c = layout.query_lens[i], layout.context_lens[i]
            mask = None
            if c != q:  # cached prefix or earlier chunks: causal with an offset
                mask = torch.arange(c)[None, :] <= (c - q + torch.arange(q))[:, None]
                mask = mask.to(device)
            prefills.append(_Prefill(q_start, q, _slots(layout.block_tables[i], bs, c).to(device), mask))
            q_start += q
        slot_mapping = layout.slot_mapping.to(device)
        store_all = bool((layout.slot_mapping >= 0).all())
        return TorchMetadata(slot_mapping, store_all, nd, decode_gather, decode_mask, prefills)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        _, _, kvh, d = k_cache.shape
        k_flat = k_cache.view(-1, kvh, d)  # [num_slots, kv_heads, head_dim]
        v_flat = v_cache.view(-1, kvh, d)
        self._store(k, v, k_flat, v_flat, meta)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            # [nd, heads, 1, d] against [nd, kv_heads, max_ctx, d]
            kk = k_flat[meta.decode_gather].transpose(1, 2)
            vv = v_flat[meta.decode_gather].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), kk, vv, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        for p in meta.prefills:
            qq = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
            kk = k_flat[p.gather].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, d]
            vv = v_flat[p.gather].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
            out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _store(k, v, k_flat, v_flat, meta: TorchMetadata) -> None:
        if meta.store_all:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
            return
        keep = meta.slot_mapping >= 0
        k_flat[meta.slot_mapping[keep]] = k[keep]
        v_flat[meta.slot_mapping[keep]] = v[keep]
