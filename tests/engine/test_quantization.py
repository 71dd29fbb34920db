"""INT8 weight-only quantization (engine/quantization.py): the round trip's error bound, the scales'
shapes and validation, and the entry for weights that arrive quantized (GGUF Q8_0's int8 blocks)."""

from __future__ import annotations

import pytest
import torch

from engine.quantization import INT8_MAX, Int8Weight, group_for, int8_from_blocks, quantize_int8


@pytest.mark.parametrize("n,k,group", [(7, 3, None), (64, 576, None), (64, 576, 64), (33, 96, 32), (5, 2, 2)])
def test_round_trip_is_within_half_a_step(n, k, group):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different scales
    q = quantize_int8(w, group)
    size = k if group is None else group
    assert q.q.dtype == torch.int8 and q.q.shape == (n, k) and q.scales.shape == (n, k // size)
    assert q.group_size == size and int(q.q.abs().max()) <= INT8_MAX
    step = q.scales.repeat_interleave(size, dim=1)  # one quantization step per element
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= step / 2 + 1e-7).all()
    # each group's largest element maps to +-127: the scale is as fine as the group allows
    groups = q.q.reshape(n, -1, size).abs().amax(dim=2)
    assert (groups == INT8_MAX).all()
    assert q.nbytes == n * k + q.scales.numel() * 4


def test_zero_rows_and_bf16_dequantize():
    w = torch.randn(4, 8)
    w[1] = 0
    q = quantize_int8(w)
    assert torch.equal(q.q[1], torch.zeros(8, dtype=torch.int8)) and q.scales[1, 0] == 1.0
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(q.dequantize(torch.bfloat16).float(), q.dequantize(torch.float32), rtol=2**-8, atol=0)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="group_size"):
        quantize_int8(torch.randn(4, 10), 4)  # does not divide K
    with pytest.raises(ValueError, match="group_size"):
        quantize_int8(torch.randn(4, 9), 3)  # odd groups
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int8(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="q must be an int8"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int16), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales must be float32"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3, 1))
    with pytest.raises(ValueError, match="groups"):
        Int8Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 3))


def test_group_for_falls_back_to_per_row():
    assert group_for(576, 64) == 64 and group_for(1536, 64) == 64
    assert group_for(100, 64) is None and group_for(64, 64) is None and group_for(576, None) is None


def test_q8_0_blocks_go_in_as_they_are():
    """A Q8_0 tensor (int8 values, a float16 scale per 32 columns) needs no float round trip."""
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (48, 96), generator=g, dtype=torch.int8)
    d = (torch.rand(48, 3, generator=g) * 0.01).half()
    w = int8_from_blocks(q, d)
    assert torch.equal(w.q, q) and w.scales.dtype == torch.float32 and w.group_size == 32
    want = q.double() * d.double().repeat_interleave(32, dim=1)
    assert torch.equal(w.dequantize(torch.float64), want)  # float16 -> float32 scales are exact
    with pytest.raises(ValueError, match="int8"):
        int8_from_blocks(q.to(torch.int16), d)
    with pytest.raises(ValueError, match="floating point"):
        int8_from_blocks(q, torch.ones(48, 3, dtype=torch.int32))
