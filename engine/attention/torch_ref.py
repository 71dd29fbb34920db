"""Reference attention in plain PyTorch (CPU and CUDA): gather the slots in use, then attend.

Cache layout, per layer: [num_kv_heads, num_blocks * block_size, head_dim] (head-major), so a
gather of a sequence's slots gives [kv_heads, ctx, head_dim] that feeds batched matmuls without
re-layout copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # decode_biases: per window (None: full attention), [num_decodes * kv_heads, 1, decode_ctx] in
    # q's dtype, 0 attend, -inf padding or outside the window.
    decode_rows: torch.Tensor | None = None
    decode_k: torch.Tensor | None = None
    decode_v: torch.Tensor | None = None
    decode_biases: dict[int | None, torch.Tensor] = field(default_factory=dict)


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

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta)
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: no packed output to assemble
            return self._decode(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, sinks)
        for p in meta.prefills:
            qq = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
            lo = _window_start(p, window)
            kk, vv = self._context_kv(k_cache, v_cache, p, meta.block_size, lo)  # [kv_heads, ctx - lo, d] each
            o = _prefill_attention(qq, kk.unsqueeze(0), vv.unsqueeze(0), p, lo, scale, window, softcap, sinks)
            out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
        return out

    # ---- what a backend with another cache layout overrides (cpu_backend.py) ----------------------
    def _decode(self, q, k_cache, v_cache, meta: TorchMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return _decode_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)

    def _context_kv(self, k_cache, v_cache, p: _Prefill, block_size: int,
                    lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefilling sequence's context from position lo on: K, V [kv_heads, context_len - lo, d]."""
        gather = p.gather[lo:]
        return k_cache.index_select(1, gather), v_cache.index_select(1, gather)

    def _store(self, k, v, k_cache, v_cache, meta: TorchMetadata) -> None:
        # k, v: [T, kv_heads, d] -> cache [kv_heads, slots, d]
        if meta.store_all:
            k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
            return
        keep = meta.slot_mapping >= 0
        k_cache[:, meta.slot_mapping[keep]] = k[keep].transpose(0, 1)
        v_cache[:, meta.slot_mapping[keep]] = v[keep].transpose(0, 1)


def _window_start(p: _Prefill, window: int | None) -> int:
    """The first context position any query row of a prefill chunk sees: its first row sits at
    context_len - q_len and sees back to window - 1 positions before that; 0 without a window."""
    if window is None:
        return 0
    return max(0, p.gather.shape[0] - p.q_len - window + 1)


def _prefill_attention(q, k, v, p: _Prefill, lo: int, scale: float, window: int | None,
                       softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [1, heads, q_len, d] over the context k, v [1, kv_heads, ctx - lo, d] that starts at
    position lo: causal with an offset, windowed, soft-capped and with sinks as asked. Returns
    [1, heads, q_len, d]."""
    ctx = p.gather.shape[0]
    mask = p.mask
    if window is not None or lo:
        kpos = torch.arange(lo, ctx, device=q.device)[None, :]  # [1, ctx - lo]
        qpos = (ctx - p.q_len + torch.arange(p.q_len, device=q.device))[:, None]  # [q_len, 1]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    # transformers' eager attention (Gemma 2, GPT-OSS): scores * scale, softcap * tanh(scores / softcap),
    # the mask, the sink logit as one more column (dropped after the softmax), softmax in float32
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [1, heads, q_len, ctx - lo]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(p.q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - p.q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(_softmax(scores, None if sinks is None else sinks.view(-1, 1)).to(q.dtype), v)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the last dim of scores [..., n]; with sinks (shaped to broadcast against
    scores.shape[:-1]: one logit per head), each row's sink logit joins the denominator (a column
    appended, dropped after: transformers' GPT-OSS eager attention)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.to(scores.dtype).unsqueeze(-1).expand(*scores.shape[:-1], 1)  # [..., 1]
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]


def _decode_attention(q, k_cache, v_cache, meta: TorchMetadata, scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence; batched matmuls per (sequence, KV head), GQA without repeating K/V.
    Much cheaper on CPU than the flash kernel for a single query row. The query of a sequence with
    context length c sits at position c - 1: with a window W it sees positions c - W .. c - 1."""
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
    bias = meta.decode_biases.get(window)
    if bias is None:
        pos = torch.arange(ctx, device=q.device)[None, :]  # [1, ctx]
        hide = pos >= meta.decode_lens[:, None]  # [nd, ctx]: padding past the context
        if window is not None:
            hide |= pos < meta.decode_lens[:, None] - window  # left the window
        bias = torch.zeros(nd, 1, ctx, dtype=q.dtype, device=q.device).masked_fill_(hide[:, None], float("-inf"))
        bias = meta.decode_biases[window] = bias.repeat_interleave(kvh, dim=0)  # [nd * kvh, 1, ctx]
    kk = torch.index_select(k_cache.view(-1, bs * d), 0, meta.decode_rows, out=meta.decode_k).view(-1, ctx, d)
    vv = torch.index_select(v_cache.view(-1, bs * d), 0, meta.decode_rows, out=meta.decode_v).view(-1, ctx, d)
    qq = q.reshape(nd * kvh, h // kvh, d)  # [nd * kvh, group, d] (a copy when q is a view into qkv)
    if softcap is None:
        # scale * q k^T + bias (0 or -inf: exact whatever the rounding), then softmax over the context.
        scores = torch.baddbmm(bias, qq, kk.transpose(1, 2), alpha=scale)  # [nd * kvh, group, ctx]
    else:
        scores = torch.bmm(qq, kk.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap + bias
    if sinks is not None:  # [heads] as [kv_heads, group, 1], the rows of each sequence
        probs = _softmax(scores.view(nd, kvh, h // kvh, ctx), sinks.view(kvh, h // kvh))
        probs = probs.reshape(nd * kvh, h // kvh, ctx).to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, vv).view(nd, h, d)
