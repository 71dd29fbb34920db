"""Allocation of the paged KV cache tensors and sizing from a memory budget."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device, backend):
    """Per layer (k_cache, v_cache), each in the backend's layout (kv_cache_shape).

    Zero-filled: attention reads padded slots through masks, and garbage there could be NaN.
    """
    shape = backend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(2, spec.num_layers, *shape, dtype=spec.dtype, device=device)
    return [(cache[0, i], cache[1, i]) for i in range(spec.num_layers)]


def allocate_grouped_kv_cache(spec: KVCacheSpec, num_blocks: list[int], layer_groups: list[int],
                              device: torch.device, backend):  # fmt: skip
    """Per layer (k_cache, v_cache) of a model with KV-cache groups (engine/kv/groups.py): each group's
    layers in their own cache of num_blocks[g] blocks, indexed by that group's block ids."""
    caches = []
    for g, n in enumerate(num_blocks):
        count = sum(1 for lg in layer_groups if lg == g)
        caches.append(iter(allocate_kv_cache(dataclasses.replace(spec, num_layers=count), n, device, backend)))
    return [next(caches[g]) for g in layer_groups]
