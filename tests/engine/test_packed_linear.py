"""oneDNN-packed linears (CPU bf16): bit-identical to F.linear, and the engine's tokens unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.packed_linear import PackedLinear, pack_linears, packing_supported
from tests.engine.helpers import make_case, make_engine, run_all

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 packing here (no oneDNN, or a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    packed = PackedLinear(lin.weight, lin.bias, batch_hint=32)
    assert torch.equal(packed(x), nn.functional.linear(x, lin.weight, lin.bias))
    assert torch.equal(packed(x.view(1, rows, 96)), packed(x).view(1, rows, 160))  # leading dims kept


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4, bias=False))).to(torch.bfloat16)
    assert pack_linears(model, batch_hint=4) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2


def test_packing_is_cpu_bf16_only():
    assert not packing_supported(torch.device("cpu"), torch.float32)
    assert not packing_supported(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # tied head (llama), biased qkv (qwen2)
def test_packed_engine_matches_unpacked(preset, build_model):
    path = build_model(preset)
    case = make_case(vocab=500, n=12, seed=3)
    # The small-batch kernels off: their start-up plan is timed, so it could differ between the two.
    packed = make_engine(path, dtype="bfloat16", cpu_gemv="off")
    plain = make_engine(path, dtype="bfloat16", pack_weights=False, cpu_gemv="off")
    assert packed.packed_weights and not plain.packed_weights
    assert any(isinstance(m, PackedLinear) for m in packed.runner.model.modules())
    assert run_all(packed, case) == run_all(plain, case)
