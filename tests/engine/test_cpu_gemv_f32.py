"""The float32 small-batch kernel (engine/kernels/csrc/cpu_gemv_f32.cpp, GemvF32Linear) and its start-up
choice: products against a float64 reference at every row-tile size and ragged shapes, bias, empty
and 3-D inputs, refused operands, routing by row count, what prepare_weights puts in a float32
model, and greedy tokens of the engine with it on against it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.api import SamplingParams
from engine.models import cpu_linear
from engine.models.cpu_linear import GemvF32Linear
from engine.weights.cpu_weights import f32_max_rows

from .helpers import make_case, make_engine, require_cpu_kernels

require_cpu_kernels()

if cpu_linear.kernels_unavailable("f32") is not None:  # a CPU without AVX2/FMA: the engine keeps F.linear
    pytest.skip(f"float32 kernel unavailable here: {cpu_linear.kernels_unavailable('f32')}", allow_module_level=True)

T = torch.ops.tokenmill


@pytest.mark.parametrize(("n", "k"), [(960, 576), (577, 33), (5, 7), (40, 1), (33, 129)])
def test_products_match_a_float64_reference(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = T.gemv_pack_f32(w)
    # row counts: every tile size (1-6), tiles of 6 with each remainder, more than one group of threads
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 40):
        x = torch.randn(m, k, generator=g)
        want = F.linear(x.double(), w.double(), b.double())
        got = T.gemv_f32(x, packed, n, k, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)
        torch.testing.assert_close(T.gemv_f32(x, packed, n, k, None).double(), want - b.double(),
                                   rtol=1e-5, atol=1e-5 * k**0.5)  # fmt: skip


def test_shapes_and_refusals():
    w = torch.randn(24, 16)
    packed = T.gemv_pack_f32(w)
    assert packed.shape == (4, 16, 8)  # ceil(24 / 8) = 3 blocks, rounded up to a group of 4
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(T.gemv_f32(x, packed, 24, 16, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert T.gemv_f32(torch.randn(0, 16), packed, 24, 16, None).shape == (0, 24)
    strided = torch.randn(16, 3).t()  # a non-contiguous x
    torch.testing.assert_close(T.gemv_f32(strided, packed, 24, 16, None), F.linear(strided, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="does not match N, K"):
        T.gemv_f32(torch.randn(1, 16), packed, 40, 16, None)
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        T.gemv_f32(torch.randn(1, 16).bfloat16(), packed, 24, 16, None)
    with pytest.raises(RuntimeError, match="bias must have N elements"):
        T.gemv_f32(torch.randn(1, 16), packed, 24, 16, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        T.gemv_pack_f32(w.bfloat16())


def test_linear_routes_by_rows(monkeypatch):
    w, b = torch.randn(48, 40), torch.randn(48)
    lin = GemvF32Linear(w, b, max_rows=4)
    kernel_rows = []
    real = T.gemv_f32

    class Ops:  # records the kernel's calls; F.linear is the other path
        def __getattr__(self, name):
            return getattr(torch.ops.tokenmill, name)

        def gemv_f32(self, x, *args):
            kernel_rows.append(x.numel() // 40)
            return real(x, *args)

    monkeypatch.setattr(cpu_linear.torch.ops, "tokenmill", Ops(), raising=False)
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert kernel_rows == [1, 4]
    assert lin.weight_bytes == 8 * 40 * 8 * 4  # 48 rows padded to 2 groups of 4 blocks of 8


def test_float32_engine_takes_the_kernel_and_keeps_its_tokens(build_model):
    path = build_model("tiny-llama")
    case = make_case(vocab=256, n=5, seed=7)
    params = [dict(max_tokens=m, temperature=0.0, ignore_eos=True) for m in case.max_tokens]
    runs = {}
    for mode in ("auto", "off"):
        engine = make_engine(path, dtype="float32", cpu_gemv=mode)
        linears = [m for m in engine.runner.model.modules() if isinstance(m, GemvF32Linear)]
        if mode == "auto":
            assert linears and all(m.max_rows == f32_max_rows() for m in linears)
            assert not any(type(m) is nn.Linear for m in engine.runner.model.modules())  # the head too
        else:
            assert not linears
        results = engine.generate(case.prompts, [SamplingParams(**p) for p in params])
        runs[mode] = [r.token_ids for r in results]
    assert runs["auto"] == runs["off"]
