"""The conv-state tensors of a hybrid model and the KV / state memory split.

Per sequence slot and per short-conv layer, the last L_cache - 1 inputs of its depthwise causal
convolution (the columns the next token's window still reads): one tensor
[conv_layers, slots, channels, L_cache - 1] in the model dtype, preallocated at start-up.

Split of the cache budget (kv_cache_memory, or what profiling leaves on CUDA): the state pool is sized
first, one slot per seat (max_num_seqs: more slots than seats are never used), at most half the budget;
the KV blocks of the attention layers get the rest. A sequence's state is a few hundred KiB at most
(LFM2-1.2B: 10 conv layers x 2,048 channels x 2 columns x 2 bytes = 80 KiB), so in practice the
pool takes a sliver and the seat count stays; a budget too small for max_num_seqs slots lowers the seat
count to the slots it holds (logged). With num_kv_blocks set, the slots are max_num_seqs outright.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ConvStateSpec:
    num_layers: int  # short-conv layers (the model's other layers keep KV blocks instead)
    channels: int  # the conv's channels (LFM2: hidden_size)
    width: int  # columns kept per sequence: L_cache - 1
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * self.channels * self.width * elem


class SlotBytes(Protocol):
    """What split_budget and the checkpoints read of a state spec: ConvStateSpec, DeltaStateSpec
    (delta_cache.py), SsmStateSpec (ssm_cache.py), or HybridSlot (all of a slot's tensors)."""

    @property
    def bytes_per_slot(self) -> int: ...


@dataclass(frozen=True)
class HybridSlot:
    """What one state slot holds: a hybrid model's conv windows and every other per-sequence tensor of its
    recurrent layers, in the same slot (Qwen3.5's DeltaNet matrices: delta_cache.DeltaStateSpec; Granite 4's
    Mamba2 SSM matrices: ssm_cache.SsmStateSpec; LFM2: none). The pool and the checkpoints are sized by the sum."""

    conv: ConvStateSpec
    recurrent: tuple[SlotBytes, ...] = ()

    @property
    def bytes_per_slot(self) -> int:
        return self.conv.bytes_per_slot + sum(r.bytes_per_slot for r in self.recurrent)


def split_budget(spec: SlotBytes, budget_bytes: int, max_num_seqs: int) -> tuple[int, int]:
    """(state slots, bytes left for KV blocks) out of `budget_bytes` (see the module docstring)."""
    slots = min(max_num_seqs, (budget_bytes // 2) // max(1, spec.bytes_per_slot))
    if slots < 1:
        raise ValueError(f"the cache budget ({budget_bytes} bytes) cannot hold one sequence's conv state "
                         f"(with any SSM state: {spec.bytes_per_slot} bytes) beside the KV blocks")  # fmt: skip
    return slots, budget_bytes - slots * spec.bytes_per_slot


def allocate_conv_state(spec: ConvStateSpec, num_slots: int, device: torch.device) -> torch.Tensor:
    """[conv_layers, slots, channels, width], zeroed (a slot is only read after its sequence wrote it)."""
    return torch.zeros(spec.num_layers, num_slots, spec.channels, spec.width, dtype=spec.dtype, device=device)
