"""The tensors of the state checkpoints and their copies, generic over a model's state tensors; and how
many checkpoint slots the cache budget gives (engine/state/checkpoints.py keeps which slot holds what).

A hybrid model's state is a list of tensors, each [layers, slots, ...] (LFM2: the conv windows
[conv_layers, slots, channels, L_cache - 1], engine/state/conv_cache.py; a model with a recurrent matrix
per layer adds its own [layers, slots, heads, k, v] beside it). For each one the store keeps a tensor
[layers, checkpoint_slots, ...] of the same dtype and device; a checkpoint copies one state slot's row
of every tensor into one checkpoint slot (`save`), and back into a state slot when a request resumes
from it (`load`). Nothing here knows what a tensor means, so a new kind of state plugs in by joining the
list.

Size: with a memory budget, the checkpoints take at most a tenth of it, and never more slots than the
KV blocks left beside them (a checkpoint is only used together with the KV blocks of its prefix, and
every prefix needs a block of its own); the KV blocks get the rest. With a block count given (no budget),
4 per seat. `num_state_checkpoints` sets the count outright (0: off).
"""

from __future__ import annotations

import torch

CHECKPOINT_SHARE = 10  # at most 1/CHECKPOINT_SHARE of the cache budget
CHECKPOINTS_PER_SEAT = 4  # without a budget (num_kv_blocks given)


def checkpoint_slots(bytes_per_slot: int, budget_bytes: int | None, bytes_per_block: int, max_num_seqs: int,
                     requested: int | None) -> int:  # fmt: skip
    """How many checkpoint slots to keep (see the module docstring); budget_bytes: what is left for the
    checkpoints and the KV blocks (None: a block count was given)."""
    if requested is not None:
        return requested
    if budget_bytes is None:
        return CHECKPOINTS_PER_SEAT * max_num_seqs
    share = (budget_bytes // CHECKPOINT_SHARE) // max(1, bytes_per_slot)
    beside = budget_bytes // max(1, bytes_per_slot + bytes_per_block)  # n checkpoints and n KV blocks fit
    return max(0, min(share, beside))


def state_bytes_per_slot(state: list[torch.Tensor]) -> int:
    """Bytes of one slot's row across the state tensors [layers, slots, ...]."""
    return sum(t[:, 0].numel() * t.element_size() for t in state)


class CheckpointStore:
    def __init__(self, state: list[torch.Tensor], num_slots: int) -> None:
        """state: the model's state tensors, each [layers, slots, ...] (the live ones the layers read
        and write); num_slots: checkpoint slots, preallocated (zeros) beside them."""
        if not state:
            raise ValueError("a checkpoint store needs at least one state tensor")
        self.state = state
        self.num_slots = num_slots
        self.saved = [torch.zeros(t.shape[0], num_slots, *t.shape[2:], dtype=t.dtype, device=t.device)
                      for t in state]  # fmt: skip
        self.bytes = num_slots * state_bytes_per_slot(state)

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slot s into checkpoint slot c for each (s, c): after the step that reached the
        checkpoint position ran."""
        if pairs:
            self._copy(self.state, self.saved, [s for s, _ in pairs], [c for _, c in pairs])

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Copy checkpoint slot c into state slot s for each (c, s): before the step that resumes from it
        runs (so before any save of that step, which may overwrite c)."""
        if pairs:
            self._copy(self.saved, self.state, [c for c, _ in pairs], [s for _, s in pairs])

    @staticmethod
    def _copy(src: list[torch.Tensor], dst: list[torch.Tensor], src_slots: list[int], dst_slots: list[int]) -> None:
        device = src[0].device
        src_index = torch.tensor(src_slots, dtype=torch.long, device=device)
        dst_index = torch.tensor(dst_slots, dtype=torch.long, device=device)
        for a, b in zip(src, dst, strict=True):  # [layers, slots, ...]: one gather and one scatter per tensor
            b.index_copy_(1, dst_index, a.index_select(1, src_index))
