"""The attention-backend contract.

The model runner packs one step's tokens as decodes first (one query token each), then prefill
chunks. It describes that layout once per step (BatchLayout); the backend turns it into whatever
per-step metadata it needs (build_metadata), then every layer calls forward() with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class BatchLayout:
    """Host-side description of one packed step; the same for every backend."""

    num_decodes: int  # the first num_decodes sequences have query_len 1 and come first
    query_lens: list[int]  # per sequence, tokens computed this step
    context_lens: list[int]  # per sequence, tokens in the cache after this step (cached + new)
    block_tables: list[list[int]]  # per sequence, its block ids in order
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] long, cache slot of each new token (-1: do not store)
    # A model with KV-cache groups (engine/kv/groups.py): groups 1.. as layouts of their own (the same rows,
    # their block tables and slots); empty with one group
    group_layouts: list[BatchLayout] = field(default_factory=list)


class AttentionMetadata:
    """Backend-specific, built once per step. Subclasses add their own fields."""


class AttentionBackend(ABC):
    name: str = "abstract"
    supports_cuda_graphs: bool = False  # implements graph_decode_metadata (engine/runner/cuda_graphs.py)
    # None: forward() takes `sinks` (GPT-OSS); else why not, for the start-up refusal (engine/engine.py)
    sinks_unsupported: str | None = None

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        """Shape of one layer's K (or V) cache in this backend's layout."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        """Precompute per-step tensors (gather indices, masks) shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # one layer's K cache, shaped by kv_cache_shape()
        v_cache: torch.Tensor,  # same
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads], any float dtype
    ) -> torch.Tensor:
        """Store k/v into their slots, then attend each query causally over its sequence's
        cached context. Returns [num_tokens, num_heads, head_dim].

        window: a sliding-window layer's W (transformers' `sliding_window`): the query at position p
        sees the keys at positions k with p - W < k <= p, its own included (W keys at most); None:
        every earlier position. Keys before p - W + 1 are never read, so a freed block there may sit
        in the block table as a placeholder (engine/kv/block_manager.py).
        softcap: attention-logit soft-capping (Gemma 2): the scaled scores s become
        softcap * tanh(s / softcap) before the mask and the softmax; None: no cap.
        sinks: learned attention sinks (GPT-OSS): per query head h one more logit sinks[h] in the
        softmax's denominator, with no value (the weights of the real keys sum to less than 1); None: none."""

    def graph_decode_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
        block_size: int, max_context: int,
    ) -> AttentionMetadata:
        """Metadata of a decode-only batch that reads persistent int64 buffers: slot_mapping [B]
        (-1: padding), block_tables [B, W], context_lens [B] (0: padding). A CUDA graph is captured
        with it once and replayed after the buffers are rewritten, so nothing in it may depend on
        their values on the host; max_context bounds every context length it will see. Only for
        backends with supports_cuda_graphs."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")
