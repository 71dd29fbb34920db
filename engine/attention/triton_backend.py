"""Attention through this repository's Triton kernels (triton_kernels.py), same cache layout as the
reference backend: per layer [num_kv_heads, num_blocks * block_size, head_dim].

Per step, every integer the kernels read (slots, context lengths, block tables, prefill tiles) is
packed into one int64 host tensor, pinned on CUDA, and sent with a single non-blocking copy; the
device-side tensors are views into it. Decode-only steps can instead run inside a CUDA graph on
persistent buffers (graph_decode_metadata; see engine/runner/cuda_graphs.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.attention import triton_kernels as K
from engine.attention.base import AttentionBackend, AttentionMetadata, BatchLayout


@dataclass(frozen=True)
class TritonTiles:
    """Tile sizes of the kernels (powers of two, at least 16): context tokens per inner step of
    decode (decode_n) and prefill (prefill_n), query rows per prefill program (prefill_m)."""

    decode_n: int = 64
    prefill_m: int = 64
    prefill_n: int = 64

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> TritonTiles:
        # float32 tiles take twice the registers: halve them
        return cls(32, 32, 32) if dtype == torch.float32 else cls()


@dataclass
class TritonMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1: do not store
    num_decodes: int
    decode_max_context: int  # an upper bound of the decode context lengths (picks the split count)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    decode_block_tables: torch.Tensor | None  # [num_decodes, width] int64
    block_size: int
    prefill_q_starts: torch.Tensor | None  # [P] int64, offset of each chunk in the packed batch
    prefill_q_lens: torch.Tensor | None  # [P] int64
    prefill_context_lens: torch.Tensor | None  # [P] int64, cached + new tokens
    prefill_block_tables: torch.Tensor | None  # [P, width] int64
    tile_seqs: torch.Tensor | None  # [tiles] int64, the chunk of each prefill query tile
    tile_rows: torch.Tensor | None  # [tiles] int64, its first query row within the chunk
    num_splits: int | None = None  # forced split count (tests); None: choose_num_splits


def _padded(rows: list[list[int]]) -> tuple[list[int], int]:
    """Rows zero-padded to the longest, flattened; and that width (1 when there are no rows)."""
    width = max((len(r) for r in rows), default=1)
    flat: list[int] = []
    for r in rows:
        flat.extend(r)
        flat.extend([0] * (width - len(r)))
    return flat, width


def _send_ints(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The int lists as int64 device tensors: views into one tensor sent in one copy (non-blocking,
    from pinned memory, on CUDA). Each part starts 16-byte aligned: Triton specialises kernels on
    pointer alignment, and changing alignments would compile them again."""
    ints: list[int] = []
    sizes: list[int] = []
    for part in parts:
        pad = len(part) % 2
        ints += part + [0] * pad
        sizes += [len(part), pad]
    host = torch.tensor(ints, dtype=torch.long)
    dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return list(dev.split(sizes))[::2]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(
        self, num_sms: int = 132, dtype: torch.dtype = torch.bfloat16, tiles: TritonTiles | None = None,
        num_splits: int | None = None,
    ) -> None:
        """num_sms: multiprocessors of the device (sizes the decode split); dtype: the model's, picks
        the tiles unless given; num_splits: force the decode split count (tests)."""
        self.num_sms = num_sms
        self.tiles = tiles or TritonTiles.for_dtype(dtype)
        self.num_splits = num_splits

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TritonMetadata:
        nd, bs = layout.num_decodes, layout.block_size
        dec_tables, dec_w = _padded(layout.block_tables[:nd])
        pf = range(nd, len(layout.query_lens))
        q_lens = [layout.query_lens[i] for i in pf]
        q_starts = list(itertools.accumulate(q_lens[:-1], initial=nd)) if q_lens else []
        pf_tables, pf_w = _padded([layout.block_tables[i] for i in pf])
        tile_seqs = [j for j, q in enumerate(q_lens) for _ in range(0, q, self.tiles.prefill_m)]
        tile_rows = [r for q in q_lens for r in range(0, q, self.tiles.prefill_m)]
        (slots, dec_ctx, dec_bt, pf_starts, pf_lens, pf_ctx, pf_bt, t_seqs, t_rows) = _send_ints(
            [layout.slot_mapping.tolist(), layout.context_lens[:nd], dec_tables, q_starts, q_lens,
             [layout.context_lens[i] for i in pf], pf_tables, tile_seqs, tile_rows],
            device,
        )
        some = bool(q_lens)
        return TritonMetadata(
            slot_mapping=slots,
            num_decodes=nd,
            decode_max_context=max(layout.context_lens[:nd], default=0),
            decode_context_lens=dec_ctx if nd else None,
            decode_block_tables=dec_bt.view(nd, dec_w) if nd else None,
            block_size=bs,
            prefill_q_starts=pf_starts if some else None,
            prefill_q_lens=pf_lens if some else None,
            prefill_context_lens=pf_ctx if some else None,
            prefill_block_tables=pf_bt.view(len(q_lens), pf_w) if some else None,
            tile_seqs=t_seqs if some else None,
            tile_rows=t_rows if some else None,
            num_splits=self.num_splits,
        )

    def graph_decode_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
        block_size: int, max_context: int,
    ) -> TritonMetadata:
        """Decode-only metadata over persistent buffers (CUDA graphs): [B] slots, [B, W] block
        tables, [B] context lengths, all int64; max_context bounds every context the graph will see."""
        return TritonMetadata(
            slot_mapping=slot_mapping, num_decodes=slot_mapping.shape[0], decode_max_context=max_context,
            decode_context_lens=context_lens, decode_block_tables=block_tables, block_size=block_size,
            prefill_q_starts=None, prefill_q_lens=None, prefill_context_lens=None, prefill_block_tables=None,
            tile_seqs=None, tile_rows=None, num_splits=self.num_splits,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        K.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        tiles = self.tiles
        nd = meta.num_decodes
        if nd:
            splits = meta.num_splits or K.choose_num_splits(nd, k_cache.shape[0], meta.decode_max_context,
                                                            self.num_sms)
            K.paged_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                           out[:nd], scale, meta.block_size, splits, tiles.decode_n, window, softcap, sinks)
        if meta.tile_seqs is not None:
            K.paged_prefill(q, k_cache, v_cache, out, meta.prefill_block_tables, meta.prefill_q_starts,
                            meta.prefill_q_lens, meta.prefill_context_lens, meta.tile_seqs, meta.tile_rows,
                            scale, meta.block_size, tiles.prefill_m, tiles.prefill_n, window, softcap, sinks)
        return out
