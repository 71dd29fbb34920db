"""One step's rows by adapter, and the delta they add inside the model's linears.

The model runner packs the step's tokens (T rows) and, for each adapter present, the rows that run on
it: a segment. Every targeted linear then adds, per segment s with rows r_s,
    y[r_s] += (x[r_s] A_s^T) B_s^T         A_s: [R_s, in], B_s: [out, R_s] (scale folded into B)
on top of whatever base product ran (PyTorch, oneDNN packed, the C++ GEMV, INT8): the base path is
untouched, base-model rows cost nothing, and each adapter costs two thin products over its own rows
(R_s <= max_lora_rank * shards, so about 2 * T_s * R_s * (in + out) flops). Segments are gathered
with index_select / index_add_, so rows need not be contiguous; a step on one adapter only skips both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LoraSegment:
    """One adapter's rows in the step."""

    layers: list[dict[str, Pair]]  # the adapter's device pairs per layer (LoraAdapter.to)
    rows: torch.Tensor | None  # [T_s] long indices into the packed tokens; None: every row


class LoraBatch:
    """The step's segments (ForwardContext.lora). Valid for one forward."""

    def __init__(self, segments: list[LoraSegment]) -> None:
        self.segments = segments

    def layer(self, index: int) -> LayerLora:
        return LayerLora([(s.layers[index], s.rows) for s in self.segments])


class LayerLora:
    """The segments' pairs of one decoder layer."""

    def __init__(self, parts: list[tuple[dict[str, Pair], torch.Tensor | None]]) -> None:
        self.parts = parts

    def add(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x, [T, out]) plus each segment's delta on its rows, in place.
        x: [T, in]. module: qkv, o, gate_up or down."""
        for pairs, rows in self.parts:
            pair = pairs.get(module)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y += (x @ a.t()) @ b.t()
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y


def build_batch(row_adapters: list[tuple[int, int, list[dict[str, Pair]] | None]], device: torch.device) -> LoraBatch | None:
    """The batch for a step whose packed rows are given as consecutive (num_rows, lora_id, pairs) runs
    (pairs None: the base model). None when no row uses an adapter."""
    runs: dict[int, tuple[list[dict[str, Pair]], list[tuple[int, int]]]] = {}
    total = start = 0
    for n, lora_id, pairs in row_adapters:
        if pairs is not None:
            runs.setdefault(lora_id, (pairs, []))[1].append((start, start + n))
        start += n
    total = start
    if not runs:
        return None
    segments = []
    for pairs, spans in runs.values():
        if len(spans) == 1 and spans[0] == (0, total):
            segments.append(LoraSegment(pairs, None))
            continue
        rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
        segments.append(LoraSegment(pairs, rows))
    return LoraBatch(segments)
