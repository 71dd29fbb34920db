"""The kernels' paths (engine/kernels/csrc/isa.h: AMX, AVX-512, AVX2, portable) give the same bits where the
code promises it, on every path this machine has: each path runs in its own process
(TOKENMILL_CPU_ISA caps it), on the same inputs, and the outputs are compared bit for bit.

Promised: the batch-invariant mode's product (gemv_blocked: the tile unit's order, emulated on AVX-512
and AVX2) on every path; the one-chain bf16 product, INT8, silu and the INT8 dequantization on AVX-512
and AVX2 (bf16 products are exact in float32: the same FMAs in the same order); attention and sampling
(fixed-lane sums, FMA on both) on AVX-512 and AVX2; the layer kernels (no FMA, fixed lanes) on every
path, portable included."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from .helpers import require_cpu_kernels

require_cpu_kernels()

ROOT = str(Path(__file__).resolve().parents[2])
LEVELS = ("amx", "avx512", "avx2", "base")
AGREE = {  # output -> the paths that must give its bits
    "blocked": {"amx", "avx512", "avx2"},
    "gemv": {"avx512", "avx2"},
    "int8": {"amx", "avx512", "avx2"},
    "silu": {"amx", "avx512", "avx2"},
    "unpack": {"amx", "avx512", "avx2"},
    "attention": {"amx", "avx512", "avx2"},
    "sampling": {"amx", "avx512", "avx2"},
    "layers": set(LEVELS),
}

OUTPUTS = """
import sys
import torch
from engine.kernels import cpu_kernels
from engine.models.quantization import quantize_int8
for g in cpu_kernels.GROUPS:
    assert cpu_kernels.load(g) is None, g
ops = torch.ops.tokenmill
g = torch.Generator().manual_seed(0)
out = {"paths": cpu_kernels.describe()}

def bf(*shape):
    return torch.randn(*shape, generator=g).bfloat16()

for n, k in ([(576, 576), (100, 64), (64, 1537), (96, 160)] if ops.gemv_supported("bf16") else []):
    w, b = bf(n, k), bf(n)
    packed = ops.gemv_pack_bf16(w, False)
    inter = ops.gemv_pack_bf16(w, True)
    q = quantize_int8(w.float(), 32 if k % 32 == 0 else None)
    qp, qs = ops.gemv_pack_int8(q.q, q.scales, False)
    for rows in (1, 3, 4, 7, 16, 33, 40):
        x = bf(rows, k)
        out[f"blocked {n}x{k} {rows}"] = ops.gemv_blocked(x, packed, n, k, b)
        out[f"gemv {n}x{k} {rows}"] = ops.gemv(x, packed, None, n, k, b)
        out[f"gemv silu {n}x{k} {rows}"] = ops.gemv_silu_mul(x, inter, None, n, k, b)
        out[f"gemv split {n}x{k} {rows}"] = ops.gemv_split(x, inter, None, n, k, None)
        out[f"int8 {n}x{k} {rows}"] = ops.gemv(x, qp, qs, n, k, b)
        out[f"int8 f32 {n}x{k} {rows}"] = ops.gemv(x.float(), qp, qs, n, k, None)
    if k % 2 == 0:
        out[f"unpack {n}x{k}"] = ops.gemv_unpack(qp, qs, n, k, False, torch.bfloat16)
g.manual_seed(1)  # each section its own inputs, whatever ran before it
out["silu"] = ops.silu_mul(bf(9, 2 * 77) * 4)

g.manual_seed(2)
for dtype in (torch.float32, torch.bfloat16):
    kvh, heads, d, bs, nb = 2, 6, 64, 16, 12
    kc, vc = torch.randn(kvh, nb * bs, d, generator=g).to(dtype), torch.randn(kvh, nb * bs, d, generator=g).to(dtype)
    qv = torch.randn(3, heads, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[:12].view(3, 4).contiguous()
    lens = torch.tensor([5, 33, 64])
    out[f"attention {dtype}"] = ops.paged_decode_attention(qv, kc, vc, tables, lens, bs, 64, 0.125)
    out[f"attention window softcap {dtype}"] = ops.paged_decode_attention(qv, kc, vc, tables, lens, bs, 64, 0.125,
                                                                          21, 4.0)
    x, res, wn = torch.randn(5, 200, generator=g).to(dtype), torch.randn(5, 200, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    out[f"layers norm {dtype}"] = ops.rms_norm(x, wn, 1e-6)
    r2 = res.clone()
    out[f"layers add_norm {dtype}"] = ops.add_rms_norm(x, r2, wn, 1e-6)
    out[f"layers residual {dtype}"] = r2
    xr = torch.randn(4, 3, 64, generator=g).to(dtype)
    ops.rotary_inplace(xr, torch.randn(4, 64, generator=g).to(dtype), torch.randn(4, 64, generator=g).to(dtype))
    out[f"layers rotary {dtype}"] = xr
    logits = (torch.randn(6, 5000, generator=g) * 3).to(dtype)
    inv_t = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.7])
    u = torch.rand(6, generator=g)
    out[f"sampling {dtype}"] = torch.stack([t.double() for t in ops.sample_rows(logits, inv_t, u)])
torch.save(out, sys.argv[1])
"""


def _outputs(level: str, tmp_path) -> dict:
    path = tmp_path / f"{level}.pt"
    env = {**os.environ, "PYTHONPATH": ROOT, "TOKENMILL_CPU_ISA": level, "TOKENMILL_REQUIRE_KERNELS": "0"}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(OUTPUTS), str(path)], env=env, capture_output=True,
                         text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(path)


def _levels_here() -> list[str]:
    """The caps that give this machine a distinct path: its best and every one below it."""
    best = torch.ops.tokenmill.gemv_path("bf16")
    top = {"AMX": 0, "AVX-512": 1, "AVX2": 2}.get(best, 3)
    return list(LEVELS[top:])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def test_paths_agree_bit_for_bit_where_promised(tmp_path):
    levels = _levels_here()
    outs = {level: _outputs(level, tmp_path) for level in levels}
    names = {"amx": "AMX", "avx512": "AVX-512", "avx2": "AVX2", "base": "portable"}
    for level, out in outs.items():  # each process ran the path it was capped to
        assert f"attention={names[level] if level != 'amx' else 'AVX-512'}" in out["paths"], out["paths"]
    compared = 0
    for key in outs[levels[0]]:
        if key == "paths":
            continue
        kind = key.split()[0]
        agreeing = [lv for lv in levels if lv in AGREE[kind]]
        for other in agreeing[1:]:
            a, b = outs[agreeing[0]][key], outs[other][key]
            assert torch.equal(_bits(a), _bits(b)), f"{key}: {agreeing[0]} and {other} differ"
            compared += 1
    assert compared > 0  # at least the layer kernels on two paths (every x86-64 CPU with AVX2 has two)
