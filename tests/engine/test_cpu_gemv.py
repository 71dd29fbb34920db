"""The C++ small-batch linear kernels (engine/kernels/csrc/cpu_gemv.cpp) against float64 math: bf16 and
INT8 weights, shapes with odd and ragged sizes (N not a multiple of 16, odd K), 1..64 rows, bias,
the fused silu(gate) * up epilogue, per-channel and grouped scales, the int32 overflow guard, the
packed layout's round trip, and the checks that refuse bad operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.quantization import int8_from_blocks, quantize_int8

from .helpers import require_cpu_kernels

require_cpu_kernels()

ops = torch.ops.tokenmill
if not (ops.gemv_supported("bf16") and ops.gemv_supported("int8")):  # no path below AVX2 + FMA
    pytest.skip("this CPU lacks AVX2/FMA (the engine falls back: tests/engine/test_cpu_linear.py)",
                allow_module_level=True)

SHAPES = [(1, 1), (7, 3), (33, 17), (100, 64), (130, 96), (576, 576), (64, 1537)]  # (N, K)
ROWS = [1, 2, 3, 4, 5, 8, 13, 31, 64]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Each element within rel of the output's scale (bf16 rounds each element to 2^-9 relative)."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert ((got.double() - want).abs() <= rel * scale).all(), float(((got.double() - want).abs() / scale).max())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_gemv_matches_float64(n, k, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = ops.gemv_pack_bf16(w, False)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = ops.gemv(x, packed, None, n, k, b)
        want = x.double() @ w.double().T + (b.double() if bias else 0)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        _close(y, want, 2**-7)  # bf16 output rounding + float32 sums
        assert _rel(y, want) < 4e-3


def test_bf16_gemv_keeps_leading_dims_and_matches_onednn():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 160, generator=g).bfloat16(), torch.randn(2, 5, 160, generator=g).bfloat16()
    y = ops.gemv(x, ops.gemv_pack_bf16(w, False), None, 96, 160, None)
    assert y.shape == (2, 5, 96)
    # float32 sums of exact bf16 products: almost always the very bf16 value F.linear gives
    assert (y == F.linear(x, w)).float().mean() > 0.99


@pytest.mark.skipif(not ops.gemv_supported("amx"), reason="no AMX on this CPU: the AVX-512 tiles take every row count")
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16, 17, 24, 32])
def test_the_amx_tile_path_matches_float64_and_onednn(rows):
    """bf16 calls of 1..32 rows with K a multiple of 32 run on the tile unit (tdpbf16ps, float32 sums;
    one A tile to 16 rows, two past it): SmolLM2's shapes, plain, gate/up with silu and split, bias;
    33+ rows and K = 1537 take the AVX-512 tiles (covered above). The tile unit sums as oneDNN's AMX
    GEMM does, so without bias the bits are oneDNN's packed product's at every row count (on
    cancelling inputs too, where the AVX-512 tiles' one chain per output differs)."""
    from engine.models.invariant_linear import TiledLinear, cancelling_inputs

    g = torch.Generator().manual_seed(rows)
    for n, k in [(960, 576), (576, 1536), (100, 64)]:
        w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = ops.gemv(x, ops.gemv_pack_bf16(w, False), None, n, k, b)
        want = x.double() @ w.double().T + b.double()
        _close(y, want, 2**-7)
        assert (y == F.linear(x, w, b)).float().mean() > 0.98
        xc, wc = cancelling_inputs(rows, k, n, seed=rows)
        assert torch.equal(ops.gemv(xc, ops.gemv_pack_bf16(wc, False), None, n, k, None), TiledLinear(wc, None).inner(xc))
    w = (torch.randn(2 * 1536, 576, generator=g) / 24).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    gate, up = F.linear(x, w).split(1536, dim=-1)
    fused = ops.gemv_silu_mul(x, ops.gemv_pack_bf16(w, True), None, 2 * 1536, 576, None)
    assert (fused == F.silu(gate) * up).float().mean() > 0.98
    split = ops.gemv_split(x, ops.gemv_pack_bf16(w, True), None, 2 * 1536, 576, None)
    assert torch.equal(split, ops.gemv(x, ops.gemv_pack_bf16(w, False), None, 2 * 1536, 576, None))


@pytest.mark.parametrize("inter,k", [(50, 40), (16, 64), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_silu_mul_matches_pytorch_ops(inter, k, bias):
    g = torch.Generator().manual_seed(inter + k)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).bfloat16()  # [gate; up]
    b = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    packed = ops.gemv_pack_bf16(w, True)
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = ops.gemv_silu_mul(x, packed, None, 2 * inter, k, b)
        gate, up = F.linear(x, w, b).split(inter, dim=-1)
        torch_ops = F.silu(gate) * up  # what the unfused MLP computes, three bf16 roundings
        h = x.double() @ w.double().T + (b.double() if bias else 0)
        exact = F.silu(h[:, :inter]) * h[:, inter:]
        assert y.shape == (rows, inter)
        _close(y, exact, 2**-6)
        assert (y == torch_ops).float().mean() > 0.98  # the same roundings; the sums may differ in the last bit


INT8_CASES = [(n, k, None) for n, k in SHAPES] + [(100, 64, 32), (130, 96, 32), (576, 576, 64), (64, 1536, 64), (9, 6, 2)]


@pytest.mark.parametrize("n,k,group", INT8_CASES)  # group None: one scale per output row
def test_int8_gemv_matches_float64(n, k, group):
    g = torch.Generator().manual_seed(n + 7 * k)
    w = torch.randn(n, k, generator=g)
    q = quantize_int8(w, group)
    packed, scales = ops.gemv_pack_int8(q.q, q.scales, False)
    wd = q.dequantize(torch.float64)
    for rows in ROWS:
        for dtype, rel in ((torch.float32, 2e-4), (torch.bfloat16, 2**-7)):
            x = torch.randn(rows, k, generator=g).to(dtype)
            y = ops.gemv(x, packed, scales, n, k, None)
            want = x.double() @ wd.T
            assert y.dtype == dtype and y.shape == (rows, n)
            # float32: only x's int16 rounding (2^-16 of its largest element) and float32 sums
            _close(y, want, rel)


def test_int8_gemv_with_bias_and_silu_mul():
    g = torch.Generator().manual_seed(3)
    inter, k = 40, 128
    w = torch.randn(2 * inter, k, generator=g) / k**0.5
    b = torch.randn(2 * inter, generator=g)
    q = quantize_int8(w, 64)
    wd = q.dequantize(torch.float64)
    plain, plain_s = ops.gemv_pack_int8(q.q, q.scales, False)
    inter_p, inter_s = ops.gemv_pack_int8(q.q, q.scales, True)
    for rows in (1, 6, 64):
        x = torch.randn(rows, k, generator=g)
        h = x.double() @ wd.T + b.double()
        _close(ops.gemv(x, plain, plain_s, 2 * inter, k, b), h, 2e-4)
        want = F.silu(h[:, :inter]) * h[:, inter:]
        _close(ops.gemv_silu_mul(x, inter_p, inter_s, 2 * inter, k, b), want, 2e-4)  # float32: no bf16 rounding
        _close(ops.gemv_silu_mul(x.bfloat16(), inter_p, inter_s, 2 * inter, k, b.bfloat16()), want, 2**-5)


def test_int8_sums_cannot_overflow():
    # Every product at its largest (127 * 32767) over 4096 columns is 1.7e10, far past int32: the
    # kernel moves its int32 sums into float32 every 256 columns.
    n, k = 16, 4096
    q = torch.full((n, k), 127, dtype=torch.int8)
    w = int8_from_blocks(q, torch.ones(n, 1))
    packed, scales = ops.gemv_pack_int8(w.q, w.scales, False)
    x = torch.ones(2, k)
    y = ops.gemv(x, packed, scales, n, k, None)
    torch.testing.assert_close(y, torch.full((2, n), 127.0 * k), rtol=1e-6, atol=0)


def test_int8_takes_minus_128():
    g = torch.Generator().manual_seed(11)
    q = torch.tensor([[-128, 127, -1, 5]], dtype=torch.int8).repeat(20, 1)
    w = int8_from_blocks(q, torch.rand(20, 2, generator=g, dtype=torch.float16) + 0.5)
    packed, scales = ops.gemv_pack_int8(w.q, w.scales, False)
    wd = w.dequantize(torch.float64)
    for _ in range(50):
        x = torch.randn(3, 4, generator=g)
        err = (ops.gemv(x, packed, scales, 20, 4, None).double() - x.double() @ wd.T).abs()
        # The activations go to int16 (one step: max|x| / 32767 per row): each output is off by at most
        # half a step per weight, plus float32 rounding. A bound on the sum, not on the output's size,
        # which cancellation can make as small as it likes.
        bound = 0.5 * x.abs().amax(-1, keepdim=True).double() / 32767 * wd.abs().sum(-1) + 1e-5
        assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("interleave", [False, True])
def test_unpack_restores_the_weight(interleave):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2 * 37, 19, generator=g).bfloat16()
    back = ops.gemv_unpack(ops.gemv_pack_bf16(w, interleave), None, 74, 19, interleave, torch.bfloat16)
    assert torch.equal(back, w)
    q = quantize_int8(w.float(), None)
    packed, scales = ops.gemv_pack_int8(q.q, q.scales, interleave)
    back = ops.gemv_unpack(packed, scales, 74, 19, interleave, torch.float32)
    assert torch.equal(back, q.dequantize(torch.float32))


def test_zero_rows_and_zero_input():
    w = torch.randn(20, 8).bfloat16()
    packed = ops.gemv_pack_bf16(w, False)
    assert ops.gemv(torch.empty(0, 8, dtype=torch.bfloat16), packed, None, 20, 8, None).shape == (0, 20)
    q = quantize_int8(w.float())
    qp, qs = ops.gemv_pack_int8(q.q, q.scales, False)
    assert torch.equal(ops.gemv(torch.zeros(2, 8), qp, qs, 20, 8, None), torch.zeros(2, 20))


def test_bad_operands_are_refused():
    w = torch.randn(20, 8).bfloat16()
    packed = ops.gemv_pack_bf16(w, False)
    with pytest.raises(RuntimeError, match="bf16 weights need bf16 x"):
        ops.gemv(torch.randn(1, 8), packed, None, 20, 8, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.gemv(torch.randn(1, 8).bfloat16(), packed, None, 100, 8, None)
    with pytest.raises(RuntimeError, match="K"):
        ops.gemv(torch.randn(1, 9).bfloat16(), packed, None, 20, 8, None)
    with pytest.raises(RuntimeError, match="scales go with int8"):
        ops.gemv(torch.randn(1, 8).bfloat16(), packed, torch.ones(2, 1, 16), 20, 8, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.gemv(torch.randn(1, 8).bfloat16(), packed, None, 20, 8, torch.ones(3))
    with pytest.raises(RuntimeError, match="even N"):
        ops.gemv_pack_bf16(torch.randn(5, 8).bfloat16(), True)
    with pytest.raises(RuntimeError, match="scales"):
        ops.gemv_pack_int8(torch.zeros(4, 6, dtype=torch.int8), torch.ones(4, 2), False)  # groups of 3: odd
    with pytest.raises(RuntimeError, match="kind"):
        ops.gemv_supported("int4")


def test_read_sum_reads_every_word():
    buf = torch.arange(100_003, dtype=torch.int64)
    assert ops.read_sum(buf) == int(buf.sum())


@pytest.mark.parametrize("n,k", [(2, 3), (66, 17), (200, 96), (3072, 576)])  # n: gate + up
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_split_product_of_an_interleaved_weight_is_the_plain_one(n, k, rows):
    """gemv_split on the interleaved gate/up layout gives [gate | up] with the bits gemv gives on the
    plain layout (each output one chain over the columns either way), bias included: what a LoRA step
    adds its delta to before the activation."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    split = ops.gemv_split(x, ops.gemv_pack_bf16(w, True), None, n, k, b)
    plain = ops.gemv(x, ops.gemv_pack_bf16(w, False), None, n, k, b)
    assert split.shape == (rows, n) and torch.equal(split, plain)
    _close(split, (x.double() @ w.double().t() + b.double()), 2**-7)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_silu_mul_gives_the_fused_products_activation(rows):
    """tokenmill::silu_mul on the plain gate/up product (what a LoRA step computes: the adapters' delta
    goes in between) equals the fused product's epilogue bit for bit, and PyTorch's silu and mul to
    within one bf16 rounding."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(2 * 1536, 576, generator=g) / 576**0.5).bfloat16()
    x = (3 * torch.randn(rows, 576, generator=g)).bfloat16()
    packed = ops.gemv_pack_bf16(w, True)
    split = ops.gemv_split(x, packed, None, 2 * 1536, 576, None)
    act = ops.silu_mul(split)
    assert act.shape == (rows, 1536) and act.dtype == torch.bfloat16
    assert torch.equal(act, ops.gemv_silu_mul(x, packed, None, 2 * 1536, 576, None))
    gate, up = split.chunk(2, dim=-1)
    _close(act, (F.silu(gate.double()) * up.double()), 2**-7)
    with pytest.raises(RuntimeError, match="bf16 CPU matrix"):
        ops.silu_mul(split.float())
