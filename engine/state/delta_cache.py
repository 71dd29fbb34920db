"""The recurrent-state tensor of Gated DeltaNet layers (Qwen3.5: engine/models/gated_deltanet.py).

Per sequence slot and per DeltaNet layer, the delta rule's state: one [k_dim, v_dim] matrix per value
head, in float32 whatever the model dtype (transformers and FLA keep it in float32: the state sums every
token so far, bf16 would drift). One tensor [delta_layers, slots, heads, k_dim, v_dim], preallocated at
start-up beside the layers' conv windows (engine/state/conv_cache.py), in the same slots (StatePool): a
slot holds a sequence's conv windows and recurrent matrices together.

For a shape with 18 DeltaNet layers of 16 heads of 128 x 128: 18 MiB a sequence (its bf16 conv windows,
18 x 6,144 channels x 3 columns: 0.6 MiB), so the state pool takes a real share of the budget: split_budget (conv_cache.py) gives it at most half, with the bytes of both tensors per slot
(conv_cache.HybridSlot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DELTA_DTYPE = torch.float32


@dataclass(frozen=True)
class DeltaStateSpec:
    num_layers: int  # DeltaNet layers (their conv windows are the conv-state tensor's rows)
    heads: int  # value heads (the query / key heads are repeated to these)
    k_dim: int
    v_dim: int

    @property
    def bytes_per_slot(self) -> int:
        elem = torch.empty(0, dtype=DELTA_DTYPE).element_size()
        return self.num_layers * self.heads * self.k_dim * self.v_dim * elem



def allocate_delta_state(spec: DeltaStateSpec, num_slots: int, device: torch.device) -> torch.Tensor:
    """[delta_layers, slots, heads, k_dim, v_dim] float32, zeroed (a slot is read only after its sequence
    wrote it: a chunk at position 0 starts from zeros, not from the slot)."""
    return torch.zeros(spec.num_layers, num_slots, spec.heads, spec.k_dim, spec.v_dim, dtype=DELTA_DTYPE,
                       device=device)  # fmt: skip
