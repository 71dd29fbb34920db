"""LFM2 GGUF files (llama.cpp's `lfm2` layout: per-layer KV head counts marking the conv layers,
shortconv.l_cache, the conv squeezed to [hidden, L_cache], token_embd_norm as the final norm) served by
the engine: greedy tokens and logits equal transformers' own GGUF load of the same file (float32; a Q8_0
file dequantized on both sides by the gguf package), and `quantization="gguf"` refused for the hybrid."""

from __future__ import annotations

import pytest
import torch

from engine.weights.gguf.reader import open_gguf
from engine.weights.model_open import open_model_source

from .gguf_helpers import LOGPROB_TOL, TOP, gguf_path, hf_from_gguf, hf_greedy, logprob_errors, small_case
from .helpers import greedy, make_engine, mismatches

PRESET = "tiny-lfm2"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-lfm2")


def test_file_says_which_layers_convolve(build_model, gguf_dir):
    path = gguf_path(build_model, gguf_dir, PRESET, "F32")
    gf = open_gguf(path)
    assert gf.arrays["lfm2.attention.head_count_kv"] == [0, 0, 2, 0, 2, 0]
    assert gf.get("lfm2.shortconv.l_cache") == 3 and gf.get("lfm2.feed_forward_length") == 256
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in gf.tensors}
    assert shapes["blk.0.shortconv.conv.weight"] == (3, 128)  # GGUF lists the fastest axis first: [hidden, L]
    assert "token_embd_norm.weight" in shapes and "output.weight" not in shapes  # tied
    cfg = open_model_source(str(path)).hf_config
    assert cfg.layer_types == ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]
    assert (cfg.num_key_value_heads, cfg.conv_L_cache, cfg.intermediate_size) == (2, 3, 256)
    assert not cfg.block_auto_adjust_ff_dim and cfg.norm_eps == pytest.approx(1e-5)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_transformers_gguf_load(build_model, gguf_dir, qtype):
    path = gguf_path(build_model, gguf_dir, PRESET, qtype)
    hf = hf_from_gguf(path)
    case = small_case(seed=5)
    ref = hf_greedy(hf, case.prompts, case.max_tokens)
    engine = make_engine(path, max_num_batched_tokens=37)  # prompt chunks cut mid-window too
    res = engine.generate(case.prompts, [greedy(m, logprobs=TOP) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.tokens) == []
    assert max(logprob_errors(res, ref)) < LOGPROB_TOL
    ours, theirs = engine.runner.model, hf.state_dict()
    assert torch.equal(ours.model.layers[0].conv.conv.weight, theirs["model.layers.0.conv.conv.weight"])
    assert torch.equal(ours.model.norm.weight, theirs["model.embedding_norm.weight"])
    assert engine.state_pool.num_used == 0


def test_gguf_block_quantization_is_refused(build_model, gguf_dir):
    path = gguf_path(build_model, gguf_dir, PRESET, "Q8_0")
    with pytest.raises(ValueError, match="quantization 'gguf' is not supported for hybrid"):
        make_engine(path, quantization="gguf")
