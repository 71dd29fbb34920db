"""INT8 weight-only quantization (engine/models/quantization.py): the round trip's error bound, the scales'
shapes and validation, and the entry for weights that arrive quantized (GGUF Q8_0's int8 blocks)."""

from __future__ import annotations

import pytest
import torch

from engine.models.quantization import INT8_MAX, Int8Weight, group_for, int8_from_blocks, quantize_int8


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


def test_preloaded_int8_weights_are_used_as_they_are(build_model):
    """The entry for a GGUF Q8_0 loader: int8 blocks by parameter name go into the model untouched."""
    from engine import EngineConfig
    from engine.models.cpu_linear import Int8Embedding, Int8Linear
    from engine.weights.cpu_weights import prepare_weights
    from engine.weights.loader import load_model
    from engine.weights.model_open import open_model_source

    path = build_model("tiny-llama")

    def model():
        return load_model(open_model_source(str(path)), torch.float32, torch.device("cpu"), 256, show_progress=False)

    m = model()
    qkv = m.model.layers[0].self_attn.qkv_proj.weight
    g = torch.Generator().manual_seed(9)
    given = int8_from_blocks(torch.randint(-127, 128, qkv.shape, generator=g, dtype=torch.int8),
                             (torch.rand(qkv.shape[0], qkv.shape[1] // 32, generator=g) * 0.01).half())
    emb = m.model.embed_tokens.weight
    emb_given = quantize_int8(emb, 32)
    config = EngineConfig(model=str(path), quantization="int8", cpu_gemv="on")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    report = prepare_weights(m, config, torch.device("cpu"), torch.float32,
                             {name: given, "model.embed_tokens.weight": emb_given})
    assert report.quantization == "int8"
    lin = m.model.layers[0].self_attn.qkv_proj
    assert isinstance(lin, Int8Linear) and lin.group_size == 32
    assert torch.equal(lin.dequantize(torch.float32), given.dequantize(torch.float32))
    other = m.model.layers[1].self_attn.qkv_proj  # not preloaded: quantized here, groups of 64
    assert other.group_size == 64
    assert isinstance(m.model.embed_tokens, Int8Embedding)
    ids = torch.tensor([0, 5, 77])
    assert torch.equal(m.model.embed_tokens(ids), emb_given.dequantize(torch.float32)[ids])
    with pytest.raises(ValueError, match="does not have"):
        prepare_weights(model(), config, torch.device("cpu"), torch.float32, {"model.nope.weight": given})
    with pytest.raises(ValueError, match="is \\("):
        prepare_weights(model(), config, torch.device("cpu"), torch.float32,
                        {"model.layers.0.self_attn.o_proj.weight": given})
    with pytest.raises(ValueError, match="need quantization='int8'"):
        prepare_weights(model(), EngineConfig(model=str(path)), torch.device("cpu"), torch.float32, {name: given})
