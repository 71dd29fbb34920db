"""The GGUF block kernels (engine/kernels/csrc/cpu_ggml.cpp, kernels/ggml_*) against the gguf package,
for every type they take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 from the gguf package's quantizer; Q4_K, Q5_K,
Q6_K from engine/testing/make_gguf.py's, since the package only dequantizes those, and as random bytes
with valid scales).

- ggml_dequantize: bit-equal to gguf.quants.dequantize (float32), and to its values rounded once (bf16).
- ggml_gemv: x W^T against float64 on the dequantized W. The kernel sums each output in 8 float32 lanes
  by FMAs (K / 8 roundings a lane), then 3 additions and the bias: a first-order bound of
  (K / 8 + 4) * 2^-24 * sum |x_c w_c| (+ |b| 2^-24), asserted with a 1% margin. Exact where the math
  allows it: integer weights and activations whose partial sums stay below 2^24.
- Every row of a call has the bits of that row alone (the tiles never mix rows); bf16 x gives
  float32 x's result rounded once.
- ggml_gemv_q8 (int8 activations): x quantized per 32 values (dx = max |x| / 127, each x off by at most
  dx / 2), integer sums, float scales: within sum_c (dx_c / 2) |w_c| (1 + 2^-10) of the exact product,
  plus the float32 bound above on the quantized x; within the float32 bound alone on integer x that quantizes to itself.
- The portable path and this CPU's (AVX2 where it has one), each in its own process
  (TOKENMILL_CPU_ISA=base caps it), give the same bits, for both products."""

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
from gguf.quants import dequantize

from engine.testing.make_gguf import random_blocks

from .helpers import require_cpu_kernels

require_cpu_kernels("ggml")

ROOT = str(Path(__file__).resolve().parents[2])
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
SHAPES = ((1, 32), (7, 96), (70, 160), (129, 576), (33, 1536))  # (N, K): odd N, tails of the 4-row tiles
K_SHAPES = ((1, 256), (7, 512), (70, 256), (33, 1536))  # K-quants: K a multiple of 256
ROWS = (1, 2, 3, 4, 5, 9, 17)
ops = torch.ops.tokenmill


def _shapes(qtype: Q) -> tuple[tuple[int, int], ...]:
    return K_SHAPES if qtype in K_QUANTS else SHAPES


def _weight(qtype: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (a quantized Gaussian matrix) and gguf's own dequantization of them."""
    blocks = random_blocks(qtype, n, k, seed)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, qtype))


def _random_bytes(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """K-quant blocks of random bytes whose fp16 scales are finite and small (every bit pattern of the
    values and 6-bit / int8 sub-scales occurs)."""
    rng = np.random.default_rng(seed)
    size = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    b = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    halves = rng.uniform(-0.01, 0.01, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        b[..., 208:210] = halves[..., 0:2]
    else:
        b[..., 0:4] = halves
    return np.ascontiguousarray(b.reshape(n, -1))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_is_the_gguf_package_bit_for_bit(qtype):
    cases = [_weight(qtype, n, k, n + k) for n, k in _shapes(qtype)]
    if qtype in K_QUANTS:
        cases += [(torch.from_numpy(b), torch.from_numpy(dequantize(b, qtype)))
                  for b in (_random_bytes(qtype, n, k, n) for n, k in K_SHAPES)]
    for blocks, ref in cases:
        n, k = ref.shape
        assert torch.equal(ops.ggml_dequantize(blocks, int(qtype), n, k, torch.float32).view(torch.int32),
                           ref.view(torch.int32))
        got16 = ops.ggml_dequantize(blocks, int(qtype), n, k, torch.bfloat16)
        assert torch.equal(got16.view(torch.int16), ref.bfloat16().view(torch.int16))


def test_dequantize_rounds_to_bf16_as_torch_does_at_the_edges():
    # Q8_0 blocks whose fp16 scale is NaN, +inf, the largest half, a subnormal: float32 values as gguf's,
    # bf16 as torch rounds float32 (ties to even, overflow to inf; a NaN stays a NaN, its payload aside:
    # the kernel writes c10::BFloat16's 0x7FC0); ties occur among the products of the subnormal and the
    # largest scales with the int8 values
    scales = np.array([np.nan, np.inf, 65504.0, 6e-8, -3.5, 0.0], dtype=np.float16)
    blocks = np.zeros((len(scales), 34), dtype=np.uint8)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = np.arange(-128, 127, 8, dtype=np.int8)[:32].view(np.uint8)
    ref = torch.from_numpy(dequantize(blocks, Q.Q8_0))
    w = torch.from_numpy(blocks)
    f32 = ops.ggml_dequantize(w, int(Q.Q8_0), len(scales), 32, torch.float32)
    assert torch.equal(f32.view(torch.int32), ref.view(torch.int32))
    got16 = ops.ggml_dequantize(w, int(Q.Q8_0), len(scales), 32, torch.bfloat16)
    nan = ref.isnan()  # the NaN scale's row, and inf * 0
    assert int(nan.sum()) == 33 and bool((got16.view(torch.int16)[nan] == 0x7FC0).all())
    assert torch.equal(got16.view(torch.int16)[~nan], ref.bfloat16().view(torch.int16)[~nan])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_gemv_within_the_float32_summation_bound(qtype):
    g = torch.Generator().manual_seed(1)
    for n, k in _shapes(qtype):
        blocks, w = _weight(qtype, n, k, 7 * n + k)
        bias = torch.randn(n, generator=g)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            y = ops.ggml_gemv(x, blocks, int(qtype), n, k, bias)
            exact = x.double() @ w.double().T + bias.double()
            bound = (k / 8 + 4) * 2.0**-24 * (x.double().abs() @ w.double().abs().T + bias.double().abs()) * 1.01
            assert y.shape == (rows, n) and y.dtype == torch.float32
            assert bool(((y.double() - exact).abs() <= bound + 1e-30).all()), f"{n}x{k}, {rows} rows"


def _q8_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """int8 activations: each x_c is off by at most dx / 2 (dx = max |x| of its 32 / 127, rounded:
    a 2^-10 margin), then float32 sums of the quantized x (|x_hat| <= |x| + dx / 2) as ggml_gemv's."""
    k = x.shape[1]
    dx = x.double().abs().view(x.shape[0], k // 32, 32).amax(-1) / 127  # [rows, units]
    half = (dx / 2).repeat_interleave(32, dim=1) * (1 + 2.0**-10)  # [rows, k]
    quant = half @ w.double().abs().T
    xhat = x.double().abs() + half
    return quant + (k / 8 + 8) * 2.0**-24 * (xhat @ w.double().abs().T + bias.double().abs()) * 1.01


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_gemv_q8_within_the_activation_quantization_bound(qtype):
    g = torch.Generator().manual_seed(4)
    for n, k in _shapes(qtype):
        blocks, w = _weight(qtype, n, k, 3 * n + k)
        bias = torch.randn(n, generator=g)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g)  # a spread of magnitudes
            x[:, :32] = 0  # a unit of zeros (dx = 0)
            y = ops.ggml_gemv_q8(x, blocks, int(qtype), n, k, bias)
            exact = x.double() @ w.double().T + bias.double()
            err = (y.double() - exact).abs()
            assert y.shape == (rows, n) and y.dtype == torch.float32
            assert bool((err <= _q8_bound(x, w, bias) + 1e-30).all()), f"{n}x{k}, {rows} rows"
            # and not the float product (it does quantize): some output differs from ggml_gemv's
            assert k == 32 or not torch.equal(y, ops.ggml_gemv(x, blocks, int(qtype), n, k, bias))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_gemv_q8_is_exact_where_x_quantizes_to_itself(qtype):
    """x integer with 127 in every unit: dx = 1, qx = x, so the activation quantization adds nothing and
    only the float sums' rounding is left (the int8 bound's quantization term is zero here)."""
    n, k = 9, 512
    blocks, w = _weight(qtype, n, k, 5)
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-127, 128, (3, k), generator=g).float()
    x[:, ::32] = 127
    y = ops.ggml_gemv_q8(x, blocks, int(qtype), n, k, None)
    exact = x.double() @ w.double().T
    bound = (k / 8 + 8) * 2.0**-24 * (x.double().abs() @ w.double().abs().T) * 1.01  # float sums only
    assert bool(((y.double() - exact).abs() <= bound).all())


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


@pytest.mark.parametrize("op", ["ggml_gemv", "ggml_gemv_q8"])
def test_rows_do_not_depend_on_the_batch_and_bf16_is_float32_rounded_once(op):
    n, k = 70, 256
    g = torch.Generator().manual_seed(3)
    gemv = getattr(ops, op)
    for qtype in TYPES:
        blocks, _ = _weight(qtype, n, k, 11)
        x = torch.randn(13, k, generator=g)
        whole = gemv(x, blocks, int(qtype), n, k, None)
        alone = torch.cat([gemv(x[i : i + 1], blocks, int(qtype), n, k, None) for i in range(13)])
        assert torch.equal(whole, alone)
        xb = x.bfloat16()
        got = gemv(xb.view(13, 1, k), blocks, int(qtype), n, k, None)  # [..., K] shapes kept
        assert got.shape == (13, 1, n) and got.dtype == torch.bfloat16
        want = gemv(xb.float(), blocks, int(qtype), n, k, None).bfloat16()
        assert torch.equal(got.view(13, n).view(torch.int16), want.view(torch.int16))


def test_bad_operands_are_refused():
    blocks, _ = _weight(Q.Q4_1, 4, 64, 0)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.ggml_gemv(torch.randn(1, 64), blocks, int(Q.Q2_K), 4, 64, None)
    with pytest.raises(RuntimeError, match="block bytes"):
        ops.ggml_gemv(torch.randn(1, 64), blocks, int(Q.Q8_0), 4, 64, None)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.ggml_gemv(torch.randn(1, 32), blocks, int(Q.Q4_1), 4, 64, None)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.ggml_gemv_q8(torch.randn(1, 64), blocks, int(Q.Q4_K), 4, 64, None)
    assert all(ops.ggml_supported(int(t)) for t in TYPES)
    assert not any(ops.ggml_supported(int(t)) for t in (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.F16))


OUTPUTS = """
import sys
import torch
from gguf import GGMLQuantizationType as Q
from engine.kernels import cpu_kernels
from engine.testing.make_gguf import random_blocks
assert cpu_kernels.load("ggml") is None
ops = torch.ops.tokenmill
out = {"path": ops.ggml_path()}
g = torch.Generator().manual_seed(0)
for t in (2, 3, 6, 7, 8, 12, 13, 14):
    for n, k in ((70, 256), (129, 768)):
        blocks = torch.from_numpy(random_blocks(Q(t), n, k, n))
        b = torch.randn(n, generator=g)
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, k, generator=g)
            out[f"{t} {n}x{k} {rows}"] = ops.ggml_gemv(x, blocks, t, n, k, b)
            out[f"{t} {n}x{k} {rows} q8"] = ops.ggml_gemv_q8(x, blocks, t, n, k, b)
        out[f"{t} {n}x{k} f32"] = ops.ggml_dequantize(blocks, t, n, k, torch.float32)
        out[f"{t} {n}x{k} bf16"] = ops.ggml_dequantize(blocks, t, n, k, torch.bfloat16).view(torch.int16).int()
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
    assert best.keys() == base.keys() and len(best) == 8 * 2 * (4 * 2 + 2)
    for key in best:
        assert torch.equal(best[key].view(torch.int32), base[key].view(torch.int32)), key
