"""Triton kernels for GGUF (ggml) quantized weights kept as the file stores them: the GPU side of
gguf_linear.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, the byte layouts of
engine/kernels/csrc/kernels/ggml.h, uint8 blocks [N, K / block values * block bytes], no repacking).

  ggml_gemv_triton        y[M, N] = x[M, K] W^T (+ bias) for decode and small M: each program a tile of
                          BLOCK_N weight rows and BLOCK_M rows of x, looping over K in units of 32 values,
                          each unit's bytes read once and decoded in registers, float32 sums
  ggml_dequantize_triton  W [N, K] in float32 (gguf.quants.dequantize's values bit for bit) or bfloat16
                          (those rounded once, to nearest even): prefill multiplies the result by torch

Every type is decoded in units of 32 values, as ggml.h's decode_unit: 32 small integers q[j] and float
scales, w[j] = s[j // 16] * q[j] (+ c), computed in gguf's order (s = d * sc rounded once, then s * q,
then + c). The dequantize launch turns off Triton's multiply-add fusion (enable_fp_fusion=False), which
would round s * q + c once instead of twice. The GEMV's sums run in another order than a float32
matmul (per unit of 32 a tree sum, then unit by unit): within float32 rounding of the product, not bit
for bit (the tests state the bound).

Multi-byte fields are read byte by byte (a block of 18 or 22 bytes leaves them 2-byte aligned at best)
and half-floats are bit-cast from the two bytes. bfloat16 is rounded from float32 with integer
arithmetic, not by a cast: the interpreter (triton 3.9) truncates where the GPU rounds to nearest.

Kernels run on CUDA, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 before this
module is imported), which is how tests/engine/test_triton_ggml.py runs them. Tiles are not tuned on a
GPU: these kernels have only run under the interpreter here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# ggml type ids (gguf_linear.KERNEL_TYPES; repeated as plain ints for the kernels' constexpr switch)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
# type -> (values per block, bytes per block)
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}  # fmt: skip


@dataclass(frozen=True)
class GGMLTiles:
    """Tile sizes (powers of two): block_n weight rows per program, block_m rows of x per program (GEMV)."""

    block_n: int = 32
    block_m: int = 4


@triton.jit
def _half(lo_ptr):
    # little-endian IEEE half at lo_ptr ([BLOCK_N] pointers) -> float32, exact
    lo = tl.load(lo_ptr).to(tl.uint16)
    hi = tl.load(lo_ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_bits(w):
    # float32 -> the int16 bits of bfloat16, rounded to nearest even (NaN kept, made quiet): the GPU
    # cast's result, computed on the bits so that the interpreter (which truncates) gives it too
    bits = w.to(tl.uint32, bitcast=True)
    up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    top = tl.where(w != w, (bits >> 16) | 0x40, up)
    return top.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _decode_unit(row_ptr, u, n_mask, TYPE: tl.constexpr, UPB: tl.constexpr, BB: tl.constexpr):
    """Unit u (values 32u .. 32u + 31) of BLOCK_N rows: float32 [BLOCK_N, 32], gguf.quants.dequantize's
    values. row_ptr: [BLOCK_N] uint8 pointers to each row's first block; masked rows read byte 0 of row 0."""
    j = tl.arange(0, 32)
    su = u % UPB  # sub-unit within its block (0 for 32-value blocks)
    base = row_ptr + (u // UPB) * BB  # [BLOCK_N] the block's first byte
    m2 = n_mask[:, None]
    if TYPE == 2 or TYPE == 3 or TYPE == 6 or TYPE == 7:  # Q4_0, Q4_1, Q5_0, Q5_1
        d = _half(base)
        hoff = 4 if (TYPE == 3 or TYPE == 7) else 2  # after d (and m)
        qoff = hoff + 4 if (TYPE == 6 or TYPE == 7) else hoff
        byte = tl.load(base[:, None] + qoff + (j % 16)[None, :], mask=m2, other=0).to(tl.int32)
        q = (byte >> (4 * (j // 16))[None, :]) & 0xF  # value j < 16: low nibble of byte j, else high of j - 16
        if TYPE == 6 or TYPE == 7:  # bit j of the u32 of high bits
            hb = tl.load(base[:, None] + hoff + (j // 8)[None, :], mask=m2, other=0).to(tl.int32)
            q = q | (((hb >> (j % 8)[None, :]) & 1) << 4)
        if TYPE == 2:
            q = q - 8
        if TYPE == 6:
            q = q - 16
        w = d[:, None] * q.to(tl.float32)
        if TYPE == 3 or TYPE == 7:
            w = w + _half(base + 2)[:, None]
    elif TYPE == 8:  # Q8_0
        d = _half(base)
        q = tl.load(base[:, None] + 2 + j[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
        w = d[:, None] * q.to(tl.float32)
    elif TYPE == 12 or TYPE == 13:  # Q4_K, Q5_K: sub-block su of a 256-value super-block
        qoff2 = 48 if TYPE == 13 else 16
        byte = tl.load(base[:, None] + qoff2 + 32 * (su // 2) + j[None, :], mask=m2, other=0).to(tl.int32)
        q = (byte >> ((su % 2) * 4)) & 0xF
        if TYPE == 13:
            hb = tl.load(base[:, None] + 16 + j[None, :], mask=m2, other=0).to(tl.int32)
            q = q | (((hb >> su) & 1) << 4)
        # the 6-bit (scale, min) pair su from the 12 packed bytes at 4 (gguf's get_scale_min)
        sp = base + 4
        a = tl.load(sp + su).to(tl.int32)
        b = tl.load(sp + su + 4).to(tl.int32)
        c = tl.load(sp + su % 4).to(tl.int32)
        lo = su < 4
        sc = tl.where(lo, a & 63, (b & 0xF) | ((c >> 6) << 4))
        mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
        s = _half(base) * sc.to(tl.float32)
        cm = _half(base + 2) * mn.to(tl.float32)
        w = s[:, None] * q.to(tl.float32) - cm[:, None]
    else:  # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d at 208
        h = su // 4
        jj = su % 4
        ql = tl.load(base[:, None] + 64 * h + 32 * (jj % 2) + j[None, :], mask=m2, other=0).to(tl.int32)
        qh = tl.load(base[:, None] + 128 + 32 * h + j[None, :], mask=m2, other=0).to(tl.int32)
        q = (((ql >> ((jj // 2) * 4)) & 0xF) | (((qh >> (2 * jj)) & 3) << 4)) - 32
        sc = tl.load(base[:, None] + 192 + 2 * su + (j // 16)[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
        s = _half(base + 208)[:, None] * sc.to(tl.float32)  # [BLOCK_N, 32]: d * scale[j // 16]
        w = s * q.to(tl.float32)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, stride_xm, stride_ym, row_bytes,
    K: tl.constexpr, TYPE: tl.constexpr, UPB: tl.constexpr, BB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # grid: (row tiles of W, row tiles of x). y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), float32 sums;
    # BF16: y holds the int16 bits of bfloat16
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = n < N
    m_mask = m < M
    row_ptr = w_ptr + tl.where(n_mask, n, 0).to(tl.int64) * row_bytes  # masked rows read row 0
    j = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for u in range(0, K // 32):
        w = _decode_unit(row_ptr, u, n_mask, TYPE, UPB, BB)  # [BLOCK_N, 32]
        xv = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + (32 * u + j)[None, :],
                     mask=m_mask[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, 32]
        acc += tl.sum(xv[:, None, :] * w[None, :, :], 2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :]
    if BF16:
        tl.store(out, _bf16_bits(acc), mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr, out_ptr, N, row_bytes,
    K: tl.constexpr, TYPE: tl.constexpr, UPB: tl.constexpr, BB: tl.constexpr, BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid: (row tiles, units of 32 columns). out[n, 32u + j] = w[n, 32u + j] (int16 bits for bfloat16)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    u = tl.program_id(1)
    n_mask = n < N
    row_ptr = w_ptr + tl.where(n_mask, n, 0).to(tl.int64) * row_bytes
    w = _decode_unit(row_ptr, u, n_mask, TYPE, UPB, BB)  # [BLOCK_N, 32] float32
    cols = 32 * u + tl.arange(0, 32)
    out = out_ptr + n[:, None].to(tl.int64) * K + cols[None, :]
    if BF16:
        tl.store(out, _bf16_bits(w), mask=n_mask[:, None])
    else:
        tl.store(out, w, mask=n_mask[:, None])


# ---- launchers ----------------------------------------------------------------------------------

INTERPRETED = type(_gemv_kernel).__name__ == "InterpretedFunction"  # decided when this module loaded
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_blocks(blocks: torch.Tensor, type_: int, n: int, k: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a checked uint8 [n, k / values * bytes] block matrix."""
    if type_ not in BLOCKS:
        raise ValueError(f"ggml type {type_} has no Triton kernel (types: {sorted(BLOCKS)})")
    values, size = BLOCKS[type_]
    want = (n, k // values * size)
    if k % values or blocks.dtype != torch.uint8 or tuple(blocks.shape) != want or not blocks.is_contiguous():
        raise ValueError(f"ggml type {type_} blocks must be contiguous uint8 {want}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if not INTERPRETED and blocks.device.type != "cuda":
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return values, size


def ggml_gemv_triton(x: torch.Tensor, blocks: torch.Tensor, type_: int, n: int, k: int,
                     bias: torch.Tensor | None = None, tiles: GGMLTiles = GGMLTiles()) -> torch.Tensor:  # fmt: skip
    """y [..., n] = x [..., k] W^T (+ bias) in x's dtype, W the ggml blocks uint8 [n, k / values * bytes]
    of type_; float32 sums (rounded once to x's dtype). bias: [n] or None."""
    values, size = _check_blocks(blocks, type_, n, k)
    if x.shape[-1] != k or x.dtype not in DTYPES or x.device != blocks.device:
        raise ValueError(f"ggml_gemv_triton: x must be [..., {k}] in one of {DTYPES} on {blocks.device}, "
                         f"got {list(x.shape)} {x.dtype} on {x.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"ggml_gemv_triton: bias must be [{n}] on {x.device}")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    m = x2.shape[0]
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty((m, n), dtype=torch.int16 if bf16 else x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m))
        _gemv_kernel[grid](
            x2, blocks, bias if bias is not None else y, y, m, n, x2.stride(0), y.stride(0), blocks.shape[1],
            K=k, TYPE=type_, UPB=values // 32, BB=size, HAS_BIAS=bias is not None, BF16=bf16,
            BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m,
        )
    return (y.view(torch.bfloat16) if bf16 else y).view(*x.shape[:-1], n)


def ggml_dequantize_triton(blocks: torch.Tensor, type_: int, n: int, k: int, dtype: torch.dtype,
                           block_n: int = 32) -> torch.Tensor:  # fmt: skip
    """W [n, k] from its ggml blocks: float32 (gguf.quants.dequantize's values bit for bit) or bfloat16
    (those rounded once to nearest even)."""
    values, size = _check_blocks(blocks, type_, n, k)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ggml_dequantize_triton: dtype must be float32 or bfloat16, got {dtype}")
    bf16 = dtype == torch.bfloat16
    out = torch.empty((n, k), dtype=torch.int16 if bf16 else torch.float32, device=blocks.device)
    if n and k:
        grid = (triton.cdiv(n, block_n), k // 32)
        _dequantize_kernel[grid](
            blocks, out, n, blocks.shape[1],
            K=k, TYPE=type_, UPB=values // 32, BB=size, BF16=bf16, BLOCK_N=block_n,
            **({} if INTERPRETED else {"enable_fp_fusion": False}),  # s * q + c rounded twice, as gguf
        )
    return out.view(torch.bfloat16) if bf16 else out


def compile_all(arch: int = 90, k: int = 1024, tiles: GGMLTiles = GGMLTiles()) -> list[str]:
    """Compile every kernel variant the launchers make (each type; GEMV with float32 and bf16 x, with a
    bias; dequantize to float32 and bf16) for compute capability `arch` without a GPU, through Triton's
    compiler and the ptxas in its wheel; one line per variant with its resources (cuobjdump). Code only
    a GPU would compile is compiled on the CPU too (tests/engine/test_triton_ggml.py). TRITON_INTERPRET
    must be unset."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.attention.triton_aot import _resources

    if INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET is set: interpreted kernels cannot be compiled")
    target, lines = GPUTarget("cuda", arch, 32), []
    for type_, (values, size) in BLOCKS.items():
        shape = dict(K=k, TYPE=type_, UPB=values // 32, BB=size)
        launches = []
        for xt in ("fp32", "bf16"):
            consts = dict(shape, HAS_BIAS=True, BF16=xt == "bf16", BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m)
            types = dict(x_ptr="*" + xt, w_ptr="*u8", bias_ptr="*" + xt, y_ptr="*i16" if xt == "bf16" else "*fp32",
                         M="i32", N="i32", stride_xm="i32", stride_ym="i32", row_bytes="i32")
            launches.append((f"gemv {xt}", _gemv_kernel, types, consts, {}))
        for bf16 in (False, True):
            consts = dict(shape, BF16=bf16, BLOCK_N=32)
            types = dict(w_ptr="*u8", out_ptr="*i16" if bf16 else "*fp32", N="i32", row_bytes="i32")
            launches.append((f"dequantize {'bf16' if bf16 else 'fp32'}", _dequantize_kernel, types, consts,
                             {"enable_fp_fusion": False}))
        for name, kernel, types, consts, opts in launches:
            sig = {a: "constexpr" if a in consts else types[a] for a in kernel.arg_names}
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=target,
                                      options={"num_warps": 4, **opts})
            lines.append(f"sm_{arch} type {type_:>2} {name:<16} ok  {_resources(compiled.asm['cubin'])}")
    return lines
