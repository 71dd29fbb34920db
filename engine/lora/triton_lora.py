"""The LoRA delta of one linear for every row of a step, each row on its own adapter, in two Triton
launches (the idea of Punica's BGMV: a row's adapter is looked up per row, so rows of many adapters
and of the base model share one launch):

  shrink   tmp[t, :R_s] = x[t] A_s^T         for each row t on adapter s = slots[t] (-1: base model)
  expand   y[t]        += tmp[t, :R_s] B_s^T

with A_s [R_s, in] and B_s^T [R_s, out] as LoraAdapter.to places them (contiguous, the adapter's scale
folded into B, the model's dtype). The contract is tokenmill::lora_add_'s (engine/kernels/csrc/cpu_lora.cpp):
one A and one B^T per segment, two empty tensors for an adapter that does not target the linear.

How the adapters reach the kernel: a table of raw addresses, not stacked copies. Row 0 is the base
model, row s + 1 segment s: (address of A_s, address of B^T_s, R_s), int64 [S + 1, 3]; a program
reads its row's entry at slots[t] + 1 and casts the addresses to pointers. Stacking the segments
into zero-padded [S, R_max, in] / [S, R_max, out] buffers would copy every adapter's matrices
once per step and linear (as many bytes as the kernel then reads, plus S copy launches), to save
the kernel one indirection; the table is S + 1 small rows, one host-to-device copy per linear
(it could be built once per step for every layer), and lets adapters of different ranks sit where
they already are. Rows of rank 0 (the base model, an adapter
that does not target the linear) get empty loops and masks: they read and write nothing.

One program per row (and per tile of R or of out), float32 sums: a matrix-vector product per row, no
tensor cores. Grouping each adapter's rows into tiles (Punica's SGMV) would let long prefills use
tl.dot; decode steps, where the delta's cost is reading the adapters, gain little from it. Tiles
are not tuned on a GPU: these kernels have only run under the Triton interpreter here.

Kernels run on CUDA, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 before
this module is imported), which is how the tests run them. The interpreter (triton 3.9) truncates
float32 to bfloat16 where the GPU rounds to nearest, so its bf16 outputs can be one ulp nearer zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class LoraTiles:
    """Tile sizes (powers of two). block_r: ranks per shrink program and per expand step; block_k:
    input features per shrink step; block_n: output features per expand program."""

    block_r: int = 16
    block_k: int = 128
    block_n: int = 128


# The table's rank column and tmp's row stride change from step to step: not specialised on.
@triton.jit(do_not_specialize=["stride_tmp"])
def _shrink_kernel(
    x_ptr, tmp_ptr, slots_ptr, table_ptr, stride_xt, stride_tmp,
    IN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (rows, rank tiles). tmp[t, r0:r0 + BLOCK_R] = A_s[r0:r0 + BLOCK_R] x[t]
    t = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BLOCK_R
    entry = tl.load(slots_ptr + t) + 1  # table row: 0 is the base model
    a_ptr = tl.load(table_ptr + entry * 3).to(tl.pointer_type(x_ptr.dtype.element_ty))
    rank = tl.load(table_ptr + entry * 3 + 2).to(tl.int32)
    r = r0 + tl.arange(0, BLOCK_R)
    r_mask = r < rank
    k_end = tl.where(rank > r0, IN, 0)  # no rank in this tile (or rank 0): no loads, no store
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < IN
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_ptr + r[:, None] * IN + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * xv[None, :], 1)  # [BLOCK_R]
    tl.store(tmp_ptr + t * stride_tmp + r, acc, mask=r_mask)


@triton.jit(do_not_specialize=["stride_tmp"])
def _expand_kernel(
    y_ptr, tmp_ptr, slots_ptr, table_ptr, stride_yt, stride_tmp,
    OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # grid: (rows, output tiles). y[t, n] += sum_r tmp[t, r] B^T_s[r, n], summed in float32
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    entry = tl.load(slots_ptr + t) + 1
    bt_ptr = tl.load(table_ptr + entry * 3 + 1).to(tl.pointer_type(y_ptr.dtype.element_ty))
    rank = tl.load(table_ptr + entry * 3 + 2).to(tl.int32)
    # rank 0 empties the output range (a scalar `rank > 0` in the mask would do the same, but the
    # interpreter turns block & scalar masks into int32 and refuses them)
    n_mask = n < tl.where(rank > 0, OUT, 0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        v = tl.load(tmp_ptr + t * stride_tmp + r, mask=r_mask, other=0.0)  # [BLOCK_R] float32
        b = tl.load(bt_ptr + r[:, None] * OUT + n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(v[:, None] * b.to(tl.float32), 0)  # [BLOCK_N]
    y = y_ptr + t * stride_yt + n
    out = tl.load(y, mask=n_mask, other=0.0).to(tl.float32) + acc
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=n_mask)


# ---- launcher -----------------------------------------------------------------------------------

INTERPRETED = type(_shrink_kernel).__name__ == "InterpretedFunction"  # decided when this module loaded
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a_list: list[torch.Tensor], bt_list: list[torch.Tensor],
                    slots: torch.Tensor, tiles: LoraTiles = LoraTiles()) -> None:  # fmt: skip
    """y[t] += (x[t] A_s^T) B_s^T for every row t with s = slots[t] >= 0, in place; y: [T, out] (rows
    may be strided), x: [T, in], slots: int64 [T] in [-1, S), a_list / bt_list: S matrices A [R_s, in]
    and B^T [R_s, out] in x's dtype (both empty: that segment does not target this linear). Slots
    are range-checked only on the CPU (on CUDA the check would wait for the device)."""
    _check(y, x, slots)
    table, max_rank = _table(x, y, a_list, bt_list)
    rows = x.shape[0]
    if rows == 0 or max_rank == 0:
        return
    if slots.device.type == "cpu" and ((slots < -1) | (slots >= len(a_list))).any():
        raise ValueError(f"lora_add_triton: slots must lie in [-1, {len(a_list)})")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = y if y.stride(1) == 1 else y.contiguous()
    tmp = torch.empty((rows, max_rank), dtype=torch.float32, device=x.device)  # [T, R_max]
    _shrink_kernel[(rows, triton.cdiv(max_rank, tiles.block_r))](
        x, tmp, slots, table, x.stride(0), tmp.stride(0),
        IN=x.shape[1], BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k,
    )
    _expand_kernel[(rows, triton.cdiv(out.shape[1], tiles.block_n))](
        out, tmp, slots, table, out.stride(0), tmp.stride(0),
        OUT=out.shape[1], BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n,
    )
    if out is not y:
        y.copy_(out)


def _check(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    if not INTERPRETED and x.device.type != "cuda":
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"lora_add_triton: x [T, in] and y [T, out] must share T, got {list(x.shape)}, "
                         f"{list(y.shape)}")  # fmt: skip
    if x.dtype not in DTYPES or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"lora_add_triton: x and y must be one of {DTYPES} on one device, got {x.dtype}, {y.dtype}")
    if slots.dtype != torch.int64 or slots.shape != (x.shape[0],) or slots.device != x.device:
        raise ValueError("lora_add_triton: slots must be int64 [T] on x's device")


def _table(x: torch.Tensor, y: torch.Tensor, a_list: list[torch.Tensor],
           bt_list: list[torch.Tensor]) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The kernels' adapter table: int64 [S + 1, 3], row 0 the base model, row s + 1 (address of A_s,
    address of B^T_s, R_s); and the largest R_s. The tensors must outlive the launches (the caller's
    lists hold them)."""
    if len(a_list) != len(bt_list):
        raise ValueError("lora_add_triton: one A and one B^T per segment")
    entries, max_rank = [(0, 0, 0)], 0
    for a, bt in zip(a_list, bt_list, strict=True):
        if a.numel() == 0 and bt.numel() == 0:  # this segment's adapter does not target the linear
            entries.append((0, 0, 0))
            continue
        if a.dtype != x.dtype or a.device != x.device or a.dim() != 2 or not a.is_contiguous() \
                or a.shape[1] != x.shape[1]:  # fmt: skip
            raise ValueError(f"lora_add_triton: A must be contiguous [R, {x.shape[1]}] {x.dtype} on {x.device}")
        if bt.dtype != x.dtype or bt.device != x.device or bt.dim() != 2 or not bt.is_contiguous() \
                or bt.shape != (a.shape[0], y.shape[1]):  # fmt: skip
            raise ValueError(f"lora_add_triton: B^T must be contiguous [{a.shape[0]}, {y.shape[1]}] with A's rank, "
                             f"{x.dtype} on {x.device}")  # fmt: skip
        entries.append((a.data_ptr(), bt.data_ptr(), a.shape[0]))
        max_rank = max(max_rank, a.shape[0])
    return torch.tensor(entries, dtype=torch.int64, device=x.device), max_rank
