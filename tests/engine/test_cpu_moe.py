"""The C++ grouped experts (engine/kernels/csrc/cpu_moe.cpp, engine/models/cpu_moe.py) against the loop over
per-expert linears it replaces (the same bits: the same kernels, the same sum back) and the dense per-token
reference (moe.dense_reference): random routing, experts with no token, every token on one expert, odd
shapes, bf16 / INT8 / float32 weights; and the engine's choice of path."""

from __future__ import annotations

import pytest
import torch

from engine.models import cpu_linear
from engine.models.cpu_linear import ALWAYS, GemvF32Linear, GemvLinear, Int8Linear
from engine.models.moe import SparseMoeBlock, dense_reference, route
from engine.models.quantization import quantize_int8

from .helpers import make_case, make_engine, require_cpu_kernels, run_all

require_cpu_kernels("linear", "moe")

if cpu_linear.kernels_unavailable("bf16") is not None:
    pytest.skip(f"linear kernels unavailable here: {cpu_linear.kernels_unavailable('bf16')}", allow_module_level=True)


def _make(kind: str, max_rows: int = ALWAYS):
    def make(weight: torch.Tensor, bias: torch.Tensor | None, role: str):
        if kind == "bf16":
            return GemvLinear(weight, bias, max_rows, 1, role == "gate_up", onednn=False)
        if kind == "int8":
            return Int8Linear(quantize_int8(weight.float(), None), bias, max_rows, True, role == "gate_up")
        return GemvF32Linear(weight, bias, max_rows)
    return make


DTYPE = {"bf16": torch.bfloat16, "int8": torch.bfloat16, "f32": torch.float32}


def _block(kind: str, hidden: int, inter: int, experts: int, top_k: int, seed: int, x_dtype: torch.dtype | None = None):
    """A SparseMoeBlock with seeded weights whose experts are the engine's linears of `kind`, plus the stacks
    (in the model dtype) for the dense reference."""
    dtype = x_dtype or DTYPE[kind]
    g = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(hidden, inter, experts, top_k, normalize=True)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    with torch.no_grad():
        block.experts.gate_up_proj = torch.nn.Parameter(gate_up.clone(), requires_grad=False)
        block.experts.down_proj = torch.nn.Parameter(down.clone(), requires_grad=False)
        block.gate.weight.copy_(torch.randn(experts, hidden, generator=g))
    block.experts.replace_linears(_make(kind))
    assert block.experts.use_cpu_kernel() is None
    assert block.experts.cpu is not None and block.experts.cpu.kind == kind
    return block, gate_up, down


def _both(block: SparseMoeBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """(the kernel's result, the loop's result) for one routing."""
    from engine.models.moe import grouped_experts

    ex = block.experts
    assert ex.cpu is not None
    with torch.inference_mode():
        got = ex.cpu(x, ids, weights)
        loop = grouped_experts(x, ids, weights, ex.expert, ex.num_experts)
    return got, loop


def _routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return route(torch.randn(tokens, experts, generator=g), top_k, normalize=True)


def _tolerance(kind: str) -> dict:
    return {"rtol": 1e-4, "atol": 1e-5} if kind == "f32" else {"rtol": 0.1, "atol": 0.03}


@pytest.mark.parametrize("kind", ["bf16", "int8", "f32"])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 8), (3, 2), (17, 4), (40, 8)])
def test_kernel_matches_the_loop_bit_for_bit_and_the_dense_reference(kind, tokens, top_k):
    hidden, inter, experts = 64, 48, 8
    block, gate_up, down = _block(kind, hidden, inter, experts, top_k, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5 + tokens)).to(DTYPE[kind])
    weights, ids = _routing(tokens, experts, top_k, seed=tokens)
    got, loop = _both(block, x, ids, weights)
    assert got.shape == (tokens, hidden) and got.dtype == x.dtype
    assert torch.equal(got, loop), (got - loop).abs().max()
    if kind != "int8":  # INT8 rounds the weights: the loop above is its reference
        want = dense_reference(x.double(), ids, weights, gate_up.double(), down.double())
        torch.testing.assert_close(got.double(), want, **_tolerance(kind))


@pytest.mark.parametrize("kind", ["bf16", "f32"])
@pytest.mark.parametrize("hidden,inter", [(33, 17), (70, 9), (16, 130)])
def test_odd_shapes(kind, hidden, inter):
    """H and I that are odd or not multiples of the blocks (padding of columns and rows)."""
    block, gate_up, down = _block(kind, hidden, inter, 5, 2, seed=hidden)
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(hidden)).to(DTYPE[kind])
    weights, ids = _routing(6, 5, 2, seed=inter)
    got, loop = _both(block, x, ids, weights)
    assert torch.equal(got, loop)
    want = dense_reference(x.double(), ids, weights, gate_up.double(), down.double())
    torch.testing.assert_close(got.double(), want, **_tolerance(kind))


@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_experts_without_tokens_are_not_read(kind):
    block, gate_up, down = _block(kind, 32, 32, 8, 2, seed=1)
    x = torch.randn(5, 32).to(DTYPE[kind])
    ids = torch.tensor([[1, 6]] * 5)  # experts 0, 2..5, 7 receive nothing
    weights = torch.full((5, 2), 0.5)
    for e in (0, 2, 3, 4, 5, 7):  # their packed weights poisoned: a read would make the output NaN
        block.experts.cpu.gate_up[e].fill_(float("nan"))
        block.experts.cpu.down[e].fill_(float("nan"))
    with torch.inference_mode():
        got = block.experts.cpu(x, ids, weights)
    assert torch.isfinite(got).all()
    want = dense_reference(x.double(), ids, weights, gate_up.double(), down.double())
    torch.testing.assert_close(got.double(), want, **_tolerance(kind))


@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_all_tokens_on_one_expert(kind):
    block, gate_up, down = _block(kind, 48, 40, 8, 1, seed=2)
    x = torch.randn(37, 48).to(DTYPE[kind])  # more rows than the AMX path's 32 too
    ids = torch.full((37, 1), 3)
    weights = torch.rand(37, 1)
    got, loop = _both(block, x, ids, weights)
    assert torch.equal(got, loop)
    want = dense_reference(x.double(), ids, weights, gate_up.double(), down.double())
    torch.testing.assert_close(got.double(), want, **_tolerance(kind))


def test_int8_experts_take_float32_rows():
    """An INT8 model served in float32: x float32, the output float32, the loop's bits."""
    block, _, _ = _block("int8", 64, 32, 6, 3, seed=4, x_dtype=torch.float32)
    x = torch.randn(9, 64)
    weights, ids = _routing(9, 6, 3, seed=4)
    got, loop = _both(block, x, ids, weights)
    assert got.dtype == torch.float32 and torch.equal(got, loop)


def test_block_forward_takes_the_kernel_up_to_max_rows_and_the_loop_above(monkeypatch):
    block, _, _ = _block("bf16", 32, 32, 8, 2, seed=6)
    block.experts.cpu.max_rows = 4
    calls = []
    real = block.experts.cpu.__class__.__call__
    monkeypatch.setattr(block.experts.cpu.__class__, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    with torch.inference_mode():
        block(torch.randn(4, 32).bfloat16())
        assert len(calls) == 1
        block(torch.randn(5, 32).bfloat16())  # the loop: each module's own kernel still
        assert len(calls) == 1


def test_bad_ids_are_refused():
    block, _, _ = _block("bf16", 32, 32, 4, 1, seed=7)
    with pytest.raises(RuntimeError, match="out of range"):
        block.experts.cpu(torch.randn(2, 32).bfloat16(), torch.tensor([[0], [4]]), torch.ones(2, 1))


def test_linears_the_kernel_does_not_take_keep_the_loop():
    block = SparseMoeBlock(32, 16, 4, 2, normalize=True)
    block.experts.gate_up_proj.data.normal_()
    block.experts.down_proj.data.normal_()
    block.experts.replace_linears(lambda w, b, role: torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
    assert "Linear" in (block.experts.use_cpu_kernel() or "")
    assert block.experts.cpu is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_serves_olmoe_on_the_kernel_and_names_it(build_model, caplog, dtype):
    """The engine puts a CPU MoE model's experts on the kernel (the start-up line says so) and decodes the
    same tokens as with the loop (the kernel's bits are the loop's)."""
    import logging

    path = build_model("tiny-olmoe")
    case = make_case(100, n=4, seed=3)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        eng = make_engine(path, dtype=dtype, cpu_gemv="on")
    assert any("C++ grouped experts" in r.getMessage() for r in caplog.records)
    blocks = eng.runner.model.moe_blocks()
    assert blocks and all(b.experts.cpu is not None for b in blocks)
    with_kernel = run_all(eng, case)
    for b in blocks:
        b.experts.cpu = None
    assert run_all(eng, case) == with_kernel
