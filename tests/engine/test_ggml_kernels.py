"""The GGUF block kernels (engine/kernels/csrc/cpu_ggml.cpp, kernels/ggml_*) against the gguf package.

- ggml_dequantize: bit-equal to gguf.quants.dequantize (float32), and to its values rounded once (bf16).
- ggml_gemv: x W^T against float64 on the dequantized W. The kernel sums each output in 8 float32 lanes
  by FMAs (K / 8 roundings a lane), then 3 additions and the bias: a first-order bound of
  (K / 8 + 4) * 2^-24 * sum |x_c w_c| (+ |b| 2^-24), asserted with a 1% margin. Exact where the math
  allows it: integer weights and activations whose partial sums stay below 2^24.
- Every row of a call has the bits of that row alone (the tiles never mix rows); bf16 x gives
  float32 x's result rounded once.
- The portable path and this CPU's (AVX2 where it has one), each in its own process
  (TOKENMILL_CPU_ISA=base caps it), give the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from .helpers import require_cpu_kernels

require_cpu_kernels("ggml")

ROOT = str(Path(__file__).resolve().parents[2])
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
SHAPES = ((1, 32), (7, 96), (70, 160), (129, 576), (33, 1536))  # (N, K): odd N, tails of the 4-row tiles
ROWS = (1, 2, 3, 4, 5, 9, 17)
ops = torch.ops.tokenmill


def _weight(qtype: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (the gguf package's quantizer) and gguf's own dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = np.ascontiguousarray(quantize(w, qtype))
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_is_the_gguf_package_bit_for_bit(qtype):
    for n, k in SHAPES:
        blocks, ref = _weight(qtype, n, k, n + k)
        assert torch.equal(ops.ggml_dequantize(blocks, int(qtype), n, k, torch.float32), ref)
        got16 = ops.ggml_dequantize(blocks, int(qtype), n, k, torch.bfloat16)
        assert torch.equal(got16.view(torch.int16), ref.bfloat16().view(torch.int16))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_gemv_within_the_float32_summation_bound(qtype):
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        blocks, w = _weight(qtype, n, k, 7 * n + k)
        bias = torch.randn(n, generator=g)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            y = ops.ggml_gemv(x, blocks, int(qtype), n, k, bias)
            exact = x.double() @ w.double().T + bias.double()
            bound = (k / 8 + 4) * 2.0**-24 * (x.double().abs() @ w.double().abs().T + bias.double().abs()) * 1.01
            assert y.shape == (rows, n) and y.dtype == torch.float32
            assert bool(((y.double() - exact).abs() <= bound + 1e-30).all()), f"{n}x{k}, {rows} rows"


def test_gemv_is_exact_on_integer_values():
    """Q8_0 blocks with scale 1 (float16 0x3C00) and integer x: every partial sum is an integer below
    2^24, so float32 makes no rounding and the result is the integer dot product."""
    n, k = 37, 256
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    scale = torch.full((n, k // 32, 1), 0x3C00, dtype=torch.int16)  # float16 1.0
    blocks = torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=2).reshape(n, -1).contiguous()
    x = torch.randint(-100, 101, (5, k), generator=g).float()
    want = (x.long() @ q.reshape(n, k).long().T).float()
    assert torch.equal(ops.ggml_gemv(x, blocks, int(Q.Q8_0), n, k, None), want)


def test_rows_do_not_depend_on_the_batch_and_bf16_is_float32_rounded_once():
    n, k = 70, 160
    g = torch.Generator().manual_seed(3)
    for qtype in TYPES:
        blocks, _ = _weight(qtype, n, k, 11)
        x = torch.randn(13, k, generator=g)
        whole = ops.ggml_gemv(x, blocks, int(qtype), n, k, None)
        alone = torch.cat([ops.ggml_gemv(x[i : i + 1], blocks, int(qtype), n, k, None) for i in range(13)])
        assert torch.equal(whole, alone)
        xb = x.bfloat16()
        got = ops.ggml_gemv(xb.view(13, 1, k), blocks, int(qtype), n, k, None)  # [..., K] shapes kept
        assert got.shape == (13, 1, n) and got.dtype == torch.bfloat16
        want = ops.ggml_gemv(xb.float(), blocks, int(qtype), n, k, None).bfloat16()
        assert torch.equal(got.view(13, n).view(torch.int16), want.view(torch.int16))


def test_bad_operands_are_refused():
    blocks, _ = _weight(Q.Q4_1, 4, 64, 0)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.ggml_gemv(torch.randn(1, 64), blocks, int(Q.Q6_K), 4, 64, None)
    with pytest.raises(RuntimeError, match="block bytes"):
        ops.ggml_gemv(torch.randn(1, 64), blocks, int(Q.Q8_0), 4, 64, None)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.ggml_gemv(torch.randn(1, 32), blocks, int(Q.Q4_1), 4, 64, None)
    assert [ops.ggml_supported(int(t)) for t in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q6_K)] == [True, True, True, False]


OUTPUTS = """
import sys
import numpy as np
import torch
from gguf.quants import quantize
from engine.kernels import cpu_kernels
assert cpu_kernels.load("ggml") is None
ops = torch.ops.tokenmill
out = {"path": ops.ggml_path()}
g = torch.Generator().manual_seed(0)
for t in (2, 3, 8):
    from gguf import GGMLQuantizationType as Q
    for n, k in ((70, 160), (129, 576)):
        w = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
        blocks = torch.from_numpy(np.ascontiguousarray(quantize(w, Q(t))))
        b = torch.randn(n, generator=g)
        for rows in (1, 3, 4, 9):
            out[f"{t} {n}x{k} {rows}"] = ops.ggml_gemv(torch.randn(rows, k, generator=g), blocks, t, n, k, b)
torch.save(out, sys.argv[1])
"""


def _outputs(level: str, tmp_path) -> dict:
    path = tmp_path / f"{level or 'best'}.pt"
    env = {**os.environ, "PYTHONPATH": ROOT, "TOKENMILL_CPU_ISA": level, "TOKENMILL_REQUIRE_KERNELS": "0"}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(OUTPUTS), str(path)], env=env, capture_output=True,
                         text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(path)


def test_portable_and_this_cpus_path_agree_bit_for_bit(tmp_path):
    best, base = _outputs("", tmp_path), _outputs("base", tmp_path)
    assert base.pop("path") == "portable"
    assert best.pop("path") == ops.ggml_path()
    assert best.keys() == base.keys() and len(best) == 24
    for key in best:
        assert torch.equal(best[key].view(torch.int32), base[key].view(torch.int32)), key
