"""Mixture-of-experts GGUF files (written with gguf.GGUFWriter as llama.cpp's converter lays them out:
expert_count / expert_used_count metadata, the experts stacked in ffn_gate_exps / ffn_up_exps /
ffn_down_exps, the router ffn_gate_inp in F32, Qwen2-MoE's ffn_*_shexp and its gate vector): qwen3moe,
qwen2moe, olmoe, gpt-oss (MXFP4 experts too), and Mixtral as `llama` with experts. Greedy tokens equal transformers on the source
folder with every matrix put through the file's encoding, and the log-probabilities within 1e-4."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.weights.gguf.reader import open_gguf

from .gguf_helpers import LOGPROB_TOL, TOP, gguf_path, hf_greedy, logprob_errors, small_case
from .helpers import MOE_PRESETS, greedy, make_engine, mismatches

ROUTERS = (".mlp.gate.weight", ".shared_expert_gate.weight", ".mlp.router.weight")  # GPT-OSS: mlp.router


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-moe")


def _reference(folder, qtype: str):
    """transformers' GGUF loader has none of these architectures: transformers on the folder, every
    matrix but the routers (F32 in the file) encoded as the file stores it and dequantized back."""
    from transformers import AutoModelForCausalLM

    from engine.testing.make_gguf import encode, type_of

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # GPT-OSS keeps its experts [E, in, out]: the file's rows (encoded along `in`) are the transposes'
    transposed = type(hf).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # stacked experts [E, rows, cols] too; not the experts' biases [E, rows] (F32 in the file)
            if p.ndim >= 2 and not name.endswith((*ROUTERS, "_bias")):
                flip = transposed and ".experts." in name
                value = p.numpy().transpose(0, 2, 1).copy() if flip else p.numpy().copy()
                data, raw = encode(value, type_of(name, qtype))
                back = torch.from_numpy(gguf.quants.dequantize(data, raw) if raw else data.astype("float32"))
                p.copy_(back.transpose(1, 2) if flip else back)
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


def test_gpt_oss_mxfp4_experts_match_transformers(build_model, gguf_dir, caplog):
    """GPT-OSS with its experts in MXFP4 (llama.cpp's MOSTLY_MXFP4_MOE; everything else F32): dequantized at
    load, a log line says what that costs; tokens and log-probabilities those of transformers on the folder
    with the experts put through MXFP4."""
    path = gguf_path(build_model, gguf_dir, "tiny-gpt-oss", "MXFP4")
    types = {t.name: t.tensor_type for t in open_gguf(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.attn_sinks.weight"] == gguf.GGMLQuantizationType.F32
    case = small_case(seed=5)
    ref = hf_greedy(_reference(build_model("tiny-gpt-oss"), "MXFP4"), case.prompts, case.max_tokens)
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        engine = make_engine(path)
    assert any("MXFP4 tensors" in r.getMessage() and "dequantized at load" in r.getMessage() for r in caplog.records)
    # no kernel keeps MXFP4 blocks: asking for them on a file with no other quantized matrix is refused
    with pytest.raises(ValueError, match="quantization 'gguf': the file holds no"):
        make_engine(path, quantization="gguf")
    res = engine.generate(case.prompts, [greedy(m, logprobs=TOP) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.tokens) == []
    assert max(logprob_errors(res, ref)) < LOGPROB_TOL
