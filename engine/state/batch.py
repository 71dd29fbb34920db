"""One step's view of the state cache: which rows of the packed batch belong to which sequence, and
that sequence's slot. Built by the model runner (engine/runner/model_runner.py) from the scheduled
requests; read and written by every short-conv layer (engine/models/short_conv.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StateBatch:
    """The step's sequences in packing order, each a run of consecutive rows of the packed [T, ...] batch.

    conv: the whole conv-state tensor [conv_layers, slots, channels, width] (engine/state/conv_cache.py);
    a layer reads and writes its own conv[layer_index]. delta: Gated DeltaNet layers' recurrent matrices
    [delta_layers, slots, heads, k_dim, v_dim] (engine/state/delta_cache.py), same slots; None: no such layer.
    """

    conv: torch.Tensor
    offsets: list[int]  # first packed row of each sequence
    lengths: list[int]  # its rows this step (1 for a decode; a prompt chunk's length, cut anywhere)
    slots: list[int]  # its state slot (StatePool)
    fresh: list[bool]  # True: its chunk starts at position 0, the window before it is zeros (not the slot)
    # slots as a tensor on the state's device, and whether every sequence is a decode that reads its
    # slot (the vectorised path: one gather, one scatter per layer)
    slot_index: torch.Tensor | None = None
    all_decode: bool = False
    delta: torch.Tensor | None = None
    # Mamba2 layers' SSM states [mamba_layers, slots, heads, head_dim, d_state] (engine/state/ssm_cache.py),
    # the same slots as conv; None: a model without them (LFM2, Qwen3.5)
    ssm: torch.Tensor | None = None

    @classmethod
    def build(cls, conv: torch.Tensor, lengths: list[int], slots: list[int], fresh: list[bool],
              delta: torch.Tensor | None = None, ssm: torch.Tensor | None = None) -> StateBatch:  # fmt: skip
        offsets, at = [], 0
        for n in lengths:
            offsets.append(at)
            at += n
        all_decode = all(n == 1 for n in lengths) and not any(fresh)
        index = torch.tensor(slots, dtype=torch.long, device=conv.device) if all_decode else None
        return cls(conv, offsets, lengths, slots, fresh, index, all_decode, delta, ssm)
