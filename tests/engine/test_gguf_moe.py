"""Mixture-of-experts GGUF files (written with gguf.GGUFWriter as llama.cpp's converter lays them out:
expert_count / expert_used_count metadata, the experts stacked in ffn_gate_exps / ffn_up_exps /
ffn_down_exps, the router ffn_gate_inp in F32, Qwen2-MoE's ffn_*_shexp and its gate vector): qwen3moe,
qwen2moe, olmoe, and Mixtral as `llama` with experts. Greedy tokens equal transformers on the source
folder with every matrix put through the file's encoding, and the log-probabilities within 1e-4."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.weights.gguf.reader import open_gguf

from .gguf_helpers import LOGPROB_TOL, TOP, gguf_path, hf_greedy, logprob_errors, small_case
from .helpers import MOE_PRESETS, greedy, make_engine, mismatches

ROUTERS = (".mlp.gate.weight", ".shared_expert_gate.weight")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-moe")


def _reference(folder, qtype: str):
    """transformers' GGUF loader has none of these architectures: transformers on the folder, every
    matrix but the routers (F32 in the file) encoded as the file stores it and dequantized back."""
    from transformers import AutoModelForCausalLM

    from engine.testing.make_gguf import TYPES, encode

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim >= 2 and not name.endswith(ROUTERS):  # stacked experts [E, rows, cols] too
                data, raw = encode(p.numpy().copy(), TYPES[qtype])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, raw) if raw else data.astype("float32")))
    return hf


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_gguf_matches_transformers(build_model, gguf_dir, preset, qtype):
    path = gguf_path(build_model, gguf_dir, preset, qtype)
    names = open_gguf(path).tensor_names()
    assert "blk.0.ffn_gate_exps.weight" in names and "blk.0.ffn_gate_inp.weight" in names
    assert ("blk.0.ffn_gate_inp_shexp.weight" in names) == (preset == "tiny-qwen2-moe")
    case = small_case(seed=5)
    ref = hf_greedy(_reference(build_model(preset), qtype), case.prompts, case.max_tokens)
    # Q8_0: attention and dense matrices kept as blocks (quantization="gguf"), experts dequantized
    # (float activations: the bit-exact path; int8 activations have their own bound, test_gguf_quantized.py)
    blocks = dict(quantization="gguf", gguf_activations="float") if qtype == "Q8_0" else {}
    engine = make_engine(path, **blocks)
    if qtype == "Q8_0":
        assert "dequantized" in (engine.weights.quantization or "")
    res = engine.generate(case.prompts, [greedy(m, logprobs=TOP) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.tokens) == []
    assert max(logprob_errors(res, ref)) < LOGPROB_TOL


def test_mixtral_is_llama_with_experts_and_qwen3moe_keeps_its_dense_layer(build_model, gguf_dir):
    from engine.weights.model_open import open_model_source

    mixtral = open_model_source(str(gguf_path(build_model, gguf_dir, "tiny-mixtral", "F32")))
    assert open_gguf(mixtral.path).architecture == "llama"
    assert mixtral.hf_config.architectures == ["MixtralForCausalLM"]
    assert (mixtral.hf_config.num_local_experts, mixtral.hf_config.num_experts_per_tok) == (8, 2)
    qwen3 = open_model_source(str(gguf_path(build_model, gguf_dir, "tiny-qwen3-moe", "F32"))).hf_config
    assert qwen3.mlp_only_layers == [1] and qwen3.moe_intermediate_size == 64 and qwen3.norm_topk_prob is True
