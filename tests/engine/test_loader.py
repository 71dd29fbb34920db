"""Loading Hugging Face folders: sharded checkpoints, tied embeddings, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .helpers import greedy, make_engine


@pytest.fixture(scope="module")
def tiny(build_model):
    return build_model("tiny-llama")


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded)
    (sharded / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    model.save_pretrained(str(sharded), max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    prompt = [[5, 9, 200, 31, 77, 12]]
    a = make_engine(tiny).generate(prompt, greedy(12, ignore_eos=True))[0].token_ids
    b = make_engine(sharded).generate(prompt, greedy(12, ignore_eos=True))[0].token_ids
    assert a == b


def test_unsupported_architecture_names_it_and_the_supported_list(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*GraniteForCausalLM.*LlamaForCausalLM.*Olmo2ForCausalLM.*Phi3ForCausalLM"):
        make_engine(bad)


def test_missing_tensor_is_a_clear_error(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(tiny, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        make_engine(bad)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        make_engine(tmp_path)


def test_tied_embeddings_share_the_embedding_matrix(build_model):
    path = build_model("tiny-qwen3")
    engine = make_engine(path, cpu_gemv="off")  # float32 on F.linear: no copy of the head at all
    model = engine.runner.model
    assert model.tie_word_embeddings and model.lm_head is None
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)
    # with the float32 kernel the head is its packed layout of the same matrix (its F.linear path
    # reads the embedding itself, not a copy)
    model = make_engine(path).runner.model
    if model.lm_head is not None:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 2.0},
])
def test_scaled_rope_matches_transformers(tiny, tmp_path, rope):
    """Llama 3 style and linear RoPE scaling (real checkpoints use them) stay token-exact."""
    from .helpers import case_fix, hf_reference

    folder = tmp_path / rope["rope_type"]
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    theta = cfg.get("rope_theta", 10000.0)
    cfg["rope_parameters"] = {**rope, "rope_theta": theta}
    cfg["rope_scaling"] = {**rope}
    (folder / "config.json").write_text(json.dumps(cfg))
    case = case_fix([[7 + (i * 13) % 1500 for i in range(n)] for n in (5, 90, 200)], [12, 12, 12])
    ref = hf_reference(folder, case)
    got = make_engine(folder).generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert [r.token_ids for r in got] == ref.token_ids



def _longrope_folder(phi3: Path, folder: Path) -> Path:
    """tiny-phi3 with Phi-4-mini's kind of rope_scaling: LongRoPE, short factors away from 1 (so they
    matter), a 2,048-token original context stretched to 4,096 (attention factor ~1.04)."""
    shutil.copytree(phi3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    half = cfg["hidden_size"] // cfg["num_attention_heads"] * 3 // 4 // 2  # partial_rotary_factor 0.75
    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [4.0] * half, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 2048}  # fmt: skip
    cfg["rope_parameters"], cfg["rope_scaling"] = rope, {**rope, "type": "longrope"}
    cfg["original_max_position_embeddings"], cfg["max_position_embeddings"] = 2048, 4096
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_longrope_short_factors_match_transformers(build_model, tmp_path):
    """Phi-3's LongRoPE below its switch (a 2,048-token original context): its short factors and
    attention factor, token-exact; the model serves its whole 4,096 (the long factors past the switch:
    tests/engine/test_longrope.py)."""
    from .helpers import case_fix, hf_reference

    folder = _longrope_folder(build_model("tiny-phi3"), tmp_path / "longrope")
    engine = make_engine(folder)
    assert engine.max_model_len == 4096 and engine.runner.model.rope_switch == 2048
    case = case_fix([[7 + (i * 13) % 1500 for i in range(n)] for n in (5, 90, 200)], [12, 12, 12])
    got = engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert [r.token_ids for r in got] == hf_reference(folder, case).token_ids
