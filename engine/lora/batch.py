"""One step's rows by adapter, and the delta they add inside the model's linears.

The model runner packs the step's tokens (T rows) and, for each adapter present, the rows that run on
it: a segment. Every targeted linear then adds, per segment s with rows r_s,
    y[r_s] += (x[r_s] A_s^T) B_s^T         A_s: [R_s, in], B_s^T: [R_s, out] (scale folded into B)
on top of whatever base product ran (PyTorch, oneDNN packed, the C++ GEMV, INT8): the base path is
untouched, base-model rows cost nothing, and each adapter costs two thin products over its own rows
(R_s <= max_lora_rank * shards, so about 2 * T_s * R_s * (in + out) flops).

How (delta_path): float32 or bf16 on the CPU, one C++ call per linear for every segment
(tokenmill::lora_add_, engine/kernels/csrc/cpu_lora.cpp: each row's slot says its segment; float32 sums; the
pairs in the model's dtype) for steps of at most CPP_MAX_ROWS rows; on CUDA, when Triton can build and
launch kernels there, two Triton launches per linear for every segment (engine/lora/triton_lora.py,
the same contract); otherwise (prompt chunks, other dtypes, no kernels) per segment in PyTorch,
gathered with index_select / index_add_ so rows need not be contiguous (a step on one adapter only
skips both).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("tokenmill.engine")

Pair = tuple[torch.Tensor, torch.Tensor]  # (A [R, in], B^T [R, out]): LoraAdapter.to (adapter.Pair, with spans)


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # triton_lora.DTYPES, without importing triton
CPP_DTYPES = (torch.float32, torch.bfloat16)  # x, y and the pairs of tokenmill::lora_add_
# Most rows a step gives tokenmill::lora_add_ (decode steps, short chunks) off the tile unit: it runs
# each adapter's rows in register tiles (~25 GMAC/s on a 2-vCPU Xeon), where a prompt chunk's hundreds
# of rows go faster as PyTorch's two products per adapter (AMX/MKL). bf16 on the tile unit takes any
# rows (SmolLM2's layer at 512 rows: 1.0 ms, PyTorch's products 1.2 ms with one adapter, 2.2 with four).
CPP_MAX_ROWS = 64
_EMPTY = torch.empty(0)  # a segment's operands for a linear its adapter does not target
_NO_SPANS = torch.empty(0, 4, dtype=torch.long)  # a pair without spans: the whole of B^T


def kernel_available() -> bool:
    """Whether the C++ delta (tokenmill::lora_add_, the kernel group "lora") is loaded."""
    from engine.kernels import cpu_kernels
    return cpu_kernels.load("lora") is None


@functools.cache  # one answer per device and process: a failed import or probe is not retried per linear
def triton_ready(device: torch.device) -> bool:
    """Whether the Triton delta (engine/lora/triton_lora.py) can run on the CUDA `device`: triton
    imports, and builds and launches a kernel there (the attention backend's probe, asked once)."""
    from engine.attention import triton_unavailable_reason

    reason = triton_unavailable_reason(device)
    if reason is None:
        try:
            from engine.lora import triton_lora  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        log.warning("LoRA on %s: no Triton delta kernel (%s); the PyTorch products run", device, reason)
    return reason is None


@functools.cache
def tile_unit() -> bool:
    """Whether tokenmill::lora_add_ runs bf16 deltas on the AMX tile unit (cpu_lora.cpp)."""
    return kernel_available() and bool(torch.ops.tokenmill.lora_amx())


def delta_path(device_type: str, dtype: torch.dtype, cpp_available: bool, triton_available: bool) -> str:
    """Which delta LayerLora.add runs for x of `dtype` on `device_type`: "cpp" (tokenmill::lora_add_,
    float32 or bf16 on the CPU), "triton" (triton_lora.lora_add_triton, CUDA) or "torch" (per segment in
    PyTorch, anything else). The Triton kernels run on the CPU only under the interpreter, far
    slower than PyTorch, so the CPU never takes them."""
    if device_type == "cpu" and dtype in CPP_DTYPES and cpp_available:
        return "cpp"
    if device_type == "cuda" and triton_available and dtype in TRITON_DTYPES:
        return "triton"
    return "torch"


@dataclass
class KernelOperands:
    """tokenmill::lora_add_'s per-segment lists for one linear (LayerLora.pairs_of)."""

    a: list[torch.Tensor]
    bt: list[torch.Tensor]
    spans: list[torch.Tensor]
    packed: list[torch.Tensor]


@dataclass
class LoraSegment:
    """One adapter's rows in the step."""

    layers: list[dict[str, Pair]]  # the adapter's device pairs per layer (LoraAdapter.to)
    rows: torch.Tensor | None  # [T_s] long indices into the packed tokens; None: every row


class LoraBatch:
    """The step's segments (ForwardContext.lora). Valid for one forward.
    slots: [T] int64, each packed row's segment index (-1: the base model), for the C++ kernel.
    invariant: the batch-invariant mode's (the C++ kernel at every row count: it sums each row in a
    fixed order, where PyTorch's products would change with the chunk)."""

    def __init__(self, segments: list[LoraSegment], slots: torch.Tensor, invariant: bool = False) -> None:
        self.segments = segments
        self.slots = slots
        self.invariant = invariant

    def layer(self, index: int) -> LayerLora:
        return LayerLora([(s.layers[index], s.rows) for s in self.segments], self.slots, self.invariant)


class LayerLora:
    """The segments' pairs of one decoder layer."""

    def __init__(self, parts: list[tuple[dict[str, Pair], torch.Tensor | None]], slots: torch.Tensor,
                 invariant: bool = False) -> None:  # fmt: skip
        self.parts = parts
        self.slots = slots
        self.invariant = invariant

    def add(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x, [T, out]) plus each segment's delta on its rows, in place.
        x: [T, in]. module: qkv, o, gate_up or down."""
        on_cuda = x.device.type == "cuda"
        path = delta_path(x.device.type, x.dtype, kernel_available(), on_cuda and triton_ready(x.device))
        if path == "cpp" and x.shape[0] > CPP_MAX_ROWS and not (x.dtype == torch.bfloat16 and tile_unit()) and not self.invariant:
            path = "torch"  # a prompt chunk: each adapter's rows as two products (oneDNN/MKL) beat the row loop
        if path == "cpp":
            return self._add_kernel(module, x, y)
        if path == "triton":
            return self._add_triton(module, x, y)
        for pairs, rows in self.parts:
            pair = pairs.get(module)
            if pair is None:
                continue
            a, bt = pair
            if rows is None:
                y += (x @ a.t()) @ bt
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ bt)
        return y

    def pairs_of(self, module: str) -> KernelOperands:
        """The kernel's operands for one linear: A, B^T, the non-zero spans of B^T and the tile-layout
        copy per segment, in segment order (the slots index them); empty tensors where a segment's
        adapter does not target `module`, an empty spans tensor for a pair without spans (the whole of
        B^T) and an empty packed one for a pair without a tile-layout copy."""
        ops = KernelOperands([], [], [], [])
        for pairs, _ in self.parts:
            pair = pairs.get(module, (_EMPTY, _EMPTY))
            ops.a.append(pair[0])
            ops.bt.append(pair[1])
            ops.spans.append(getattr(pair, "spans", _NO_SPANS))
            packed = getattr(pair, "packed", None)
            ops.packed.append(_EMPTY if packed is None else packed)
        return ops

    def _add_kernel(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ops = self.pairs_of(module)
        out = y if y.is_contiguous() else y.contiguous()
        torch.ops.tokenmill.lora_add_(out, x.contiguous(), ops.a, ops.bt, self.slots, ops.spans, ops.packed)
        if out is not y:
            y.copy_(out)
        return y

    def _add_triton(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from engine.lora.triton_lora import lora_add_triton

        ops = self.pairs_of(module)  # B^T is zero outside the spans: the same sums
        lora_add_triton(y, x, ops.a, ops.bt, self.slots)  # takes a strided y (a fused product's split)
        return y


def build_batch(row_adapters: list[tuple[int, int, list[dict[str, Pair]] | None]], device: torch.device,
                invariant: bool = False) -> LoraBatch | None:  # fmt: skip
    """The batch for a step whose packed rows are given as consecutive (num_rows, lora_id, pairs) runs
    (pairs None: the base model). None when no row uses an adapter. invariant: LoraBatch's."""
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
    slots = [-1] * total
    for index, (pairs, spans) in enumerate(runs.values()):
        for a, b in spans:
            slots[a:b] = [index] * (b - a)
        if len(spans) == 1 and spans[0] == (0, total):
            segments.append(LoraSegment(pairs, None))
            continue
        rows = torch.tensor([r for a, b in spans for r in range(a, b)], dtype=torch.long)
        segments.append(LoraSegment(pairs, rows.to(device)))
    slots = torch.tensor(slots, dtype=torch.long)
    return LoraBatch(segments, slots.to(device), invariant)
