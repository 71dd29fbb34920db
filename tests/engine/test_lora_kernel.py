"""The LoRA delta (float32 or bf16 rows; float32 pairs, or bf16 ones with bf16 rows) in one C++ call per linear (tokenmill::lora_add_, engine/lora/batch.py)
against the per-segment PyTorch form: mixed segments, base-model rows, an adapter that does not
target the module, refused operands. The end-to-end parity with peft (tests/engine/test_lora.py) runs
through it in float32."""

from __future__ import annotations

import pytest
import torch

from engine.lora import batch as lora_batch
from engine.lora.batch import build_batch

from .helpers import require_cpu_kernels

require_cpu_kernels()

IN, OUT = 40, 56


def _pairs(rank: int, g: torch.Generator) -> list[dict]:
    return [{"m": (torch.randn(rank, IN, generator=g), torch.randn(rank, OUT, generator=g))}]


def test_kernel_equals_the_pytorch_form(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a4, a8, untargeted = _pairs(4, g), _pairs(8, g), [{}]
    # packed runs (rows, lora_id, pairs): adapter 1 in two places, base rows between, one adapter without "m"
    runs = [(3, 1, a4), (2, 0, None), (1, 2, a8), (4, 1, a4), (2, 3, untargeted)]
    batch = build_batch(runs, torch.device("cpu"))
    assert batch.slots.tolist() == [0, 0, 0, -1, -1, 1, 0, 0, 0, 0, 2, 2]
    x, y = torch.randn(12, IN, generator=g), torch.randn(12, OUT, generator=g)
    layer = batch.layer(0)
    got = layer.add("m", x, y.clone())
    monkeypatch.setattr(lora_batch, "kernel_available", lambda: False)
    want = layer.add("m", x, y.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unchanged = [3, 4, 10, 11]  # base-model rows and the adapter that does not target "m"
    assert torch.equal(got[unchanged], y[unchanged])
    assert not torch.equal(got[0], y[0])


def test_kernel_takes_a_non_contiguous_output():
    g = torch.Generator().manual_seed(1)
    batch = build_batch([(5, 1, _pairs(4, g))], torch.device("cpu"))
    x = torch.randn(5, IN, generator=g)
    wide = torch.randn(5, 2 * OUT, generator=g)
    y = wide[:, :OUT]  # a view, as a fused product's split gives
    before = y.clone()
    a, bt = batch.segments[0].layers[0]["m"]
    batch.layer(0).add("m", x, y)
    torch.testing.assert_close(wide[:, :OUT], before + (x @ a.t()) @ bt, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_bad_operands():
    op = torch.ops.tokenmill.lora_add_
    x, y = torch.randn(2, IN), torch.randn(2, OUT)
    a, bt = torch.randn(4, IN), torch.randn(4, OUT)
    with pytest.raises(RuntimeError, match="out of range"):
        op(y, x, [a], [bt], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="with A's rank"):
        op(y, x, [a], [torch.randn(3, OUT)], torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        op(y.half(), x.half(), [a], [bt], torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="of x's dtype"):
        op(y, x.bfloat16(), [a], [bt], torch.tensor([0, 0]))


@pytest.mark.parametrize("pairs", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [4, 5, 17])
def test_bf16_rows_get_the_float32_delta_rounded_once(pairs, rank):
    """bf16 x and y with float32 or bf16 pairs: each row's delta is summed in float32 on the widened
    operands and added to y's row in float32, one rounding to bf16 at the end (a few rows and ranks
    that are not multiples of the tiles, so the short groups run too); base rows are left alone."""
    g = torch.Generator().manual_seed(2)
    a, bt = torch.randn(rank, IN, generator=g).to(pairs), torch.randn(rank, OUT, generator=g).to(pairs)
    batch = build_batch([(6, 1, [{"m": (a, bt)}]), (2, 0, None)], torch.device("cpu"))
    x = torch.randn(8, IN, generator=g).bfloat16()
    y = torch.randn(8, OUT, generator=g).bfloat16()
    got = batch.layer(0).add("m", x, y.clone())
    want = (y[:6].double() + (x[:6].double() @ a.double().t()) @ bt.double())
    assert got.dtype == torch.bfloat16
    # one rounding of a float32 sum: within a bf16 half-ulp of the exact value (plus float32 noise)
    assert ((got[:6].double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    assert torch.equal(got[6:], y[6:])


def test_mixed_pair_dtypes_are_refused():
    op = torch.ops.tokenmill.lora_add_
    x, y = torch.randn(2, IN).bfloat16(), torch.randn(2, OUT).bfloat16()
    a, bt = torch.randn(4, IN), torch.randn(4, OUT)
    with pytest.raises(RuntimeError, match="one dtype for every adapter"):
        op(y, x, [a, a.bfloat16()], [bt, bt.bfloat16()], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="or bf16 with bf16 rows"):
        op(y.float(), x.float(), [a.bfloat16()], [bt.bfloat16()], torch.tensor([0, 0]))
