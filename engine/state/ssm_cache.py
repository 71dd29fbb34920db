"""The SSM-state tensors of a hybrid model's Mamba2 layers (Granite 4: engine/models/mamba2.py).

Per sequence slot and per Mamba2 layer, the selective scan's recurrent matrix [heads, head_dim, d_state]:
one tensor [mamba_layers, slots, heads, head_dim, d_state], preallocated at start-up beside the layers'
conv windows (engine/state/conv_cache.py: the same slot index in both). Kept in float32 whatever the
model dtype: the chunked scan computes it in float32 (as transformers' does), and a state carried over
thousands of decode steps in bf16 would drift.

A slot holds both: conv_cache.HybridSlot's bytes_per_slot is what split_budget (conv_cache.py) sizes the pool by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SsmStateSpec:
    num_layers: int  # Mamba2 layers (the model's other layers keep KV blocks or no state)
    heads: int  # mamba_n_heads
    head_dim: int  # mamba_d_head
    state_size: int  # mamba_d_state
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_slot(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * self.heads * self.head_dim * self.state_size * elem



def allocate_ssm_state(spec: SsmStateSpec, num_slots: int, device: torch.device) -> torch.Tensor:
    """[mamba_layers, slots, heads, head_dim, d_state], zeroed (a slot is read only after its sequence's
    first chunk wrote it: a chunk at position 0 starts from zeros, not from the slot)."""
    return torch.zeros(spec.num_layers, num_slots, spec.heads, spec.head_dim, spec.state_size, dtype=spec.dtype,
                       device=device)  # fmt: skip
