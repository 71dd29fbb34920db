"""Compile the Triton kernels ahead of time for a GPU architecture, without a GPU.

    python -m engine.attention.triton_aot [--arch 90] [--dtype bfloat16] [--heads 14 --kv-heads 2 --head-dim 64]

Builds every kernel variant the Triton backend launches for one model shape (store, decode with and
without split, merge, prefill) through Triton's compiler down to a cubin with the ptxas that
Triton's wheel bundles, and prints each one's registers, stack and shared memory (cuobjdump). The
tests run it so that code only a GPU would compile is compiled on the CPU too; it also reads the
resource report at no device time. TRITON_INTERPRET must be unset: interpreted kernels do not compile.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.attention import triton_kernels as K
from engine.attention.triton_backend import TritonTiles

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class Compiled:
    kernel: str
    constexprs: dict
    shared_bytes: int
    resources: str  # cuobjdump's REG/STACK/LOCAL line ("" without cuobjdump)


def variants(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int):
    """(kernel, signature, constexprs) for each launch the backend makes for this shape; the
    constexprs are computed as the launchers compute them."""
    p, tiles, group = "*" + _TY[dtype], TritonTiles.for_dtype(dtype), heads // kv_heads
    strides = dict(stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_ch="i64",
                   stride_cs="i32", stride_bt="i32")
    f32 = dtype == torch.float32
    out = [(K._store_kv_kernel,
            dict(k_ptr=p, v_ptr=p, k_cache_ptr=p, v_cache_ptr=p, slot_ptr="*i64", stride_kt="i32", stride_kh="i32",
                 stride_vt="i32", stride_vh="i32", stride_ch="i64", stride_cs="i32"),
            dict(NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
                 BLOCK_D=triton.next_power_of_2(head_dim)))]
    # without and with a sliding window, soft-capping and sinks (engine/attention/base.py's window, softcap, sinks)
    for window, cap in ((False, False), (True, True)):
        for split in (False, True):
            part = "*fp32" if split else p
            out.append((K._decode_kernel,
                        dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i64",
                             context_lens_ptr="*i64", out_ptr=p, part_m_ptr=part, part_l_ptr=part, part_acc_ptr=part,
                             sinks_ptr="*fp32",
                             scale="fp32", num_heads="i32", num_splits="i32", window="i32", softcap="fp32",
                             **strides),
                        dict(GROUP=group, HEAD_DIM=head_dim, CACHE_BLOCK=block_size, SPLIT=split,
                             BLOCK_G=K._pow2(group), BLOCK_D=K._pow2(head_dim), BLOCK_N=tiles.decode_n, F32=f32,
                             WINDOW=window, SOFTCAP=cap, SINKS=window)))
        out.append((K._prefill_kernel,
                    dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, out_ptr=p, block_tables_ptr="*i64",
                         q_starts_ptr="*i64", q_lens_ptr="*i64", context_lens_ptr="*i64", tile_seqs_ptr="*i64",
                         tile_rows_ptr="*i64", sinks_ptr="*fp32", scale="fp32", window="i32", softcap="fp32",
                         **strides),
                    dict(GROUP=group, HEAD_DIM=head_dim, CACHE_BLOCK=block_size, BLOCK_M=tiles.prefill_m,
                         BLOCK_N=tiles.prefill_n, BLOCK_D=K._pow2(head_dim), F32=f32, WINDOW=window, SOFTCAP=cap,
                         SINKS=window)))
    out.append((K._merge_kernel,
                dict(part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32", out_ptr=p, sinks_ptr="*fp32",
                     num_heads="i32", num_splits="i32", stride_ot="i32", stride_oh="i32"),
                dict(HEAD_DIM=head_dim, BLOCK_S=K.MAX_SPLITS, BLOCK_D=triton.next_power_of_2(head_dim), SINKS=True)))
    return out


def compile_all(arch: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                block_size: int = 16) -> list[Compiled]:
    if K.INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET is set: interpreted kernels cannot be compiled")
    target = GPUTarget("cuda", arch, 32)
    done = []
    for kernel, types, consts in variants(dtype, heads, kv_heads, head_dim, block_size):
        sig = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
        warps = K.ATTN_WARPS if kernel in (K._decode_kernel, K._prefill_kernel) else 4  # as the launchers
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=target,
                                  options={"num_warps": warps})
        done.append(Compiled(kernel.__name__, consts, compiled.metadata.shared, _resources(compiled.asm["cubin"])))
    return done


def _resources(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", text)
    return m.group(0) if m else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (H100/H200: 90)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args(argv)
    for c in compile_all(a.arch, getattr(torch, a.dtype), a.heads, a.kv_heads, a.head_dim, a.block_size):
        flags = {k: v for k, v in c.constexprs.items() if k in ("SPLIT", "F32", "BLOCK_M", "BLOCK_N", "BLOCK_G")}
        print(f"sm_{a.arch} {a.dtype} {c.kernel:<17} ok  {c.resources or f'shared {c.shared_bytes}'}  {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
