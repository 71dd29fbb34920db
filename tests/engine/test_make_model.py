"""engine.testing.make_model: the generated folders load with transformers and are deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.testing import make_model
from engine.testing.make_model import PRESETS, build_model, ensure_model

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
ROUND_TRIP_TEXTS = [
    "Hello, world! def f(x):\n\treturn x ** 2  # 12345",
    "你好，世界！机器学习很有意思。",
    "こんにちは、東京。カタカナ",
    "emoji 😀🚀 family 👨‍👩‍👧 flag 🇯🇵 skin 👍🏽 heart ❤️",
    "  two leading spaces, trailing  ",
    "混合 mixed 🤖 text\r\nwith CRLF",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root / name) for name in TINY}


def _greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            next_token = model(tokens).logits[0, -1].argmax().view(1, 1)
            tokens = torch.cat([tokens, next_token], dim=1)
    return tokens[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", TINY)
def test_folder_has_every_file(built: dict[str, Path], name: str) -> None:
    for file in make_model.REQUIRED_FILES:
        assert (built[name] / file).is_file(), file
    assert make_model.is_complete(built[name], name)


@pytest.mark.parametrize("name", TINY)
def test_loads_with_transformers(built: dict[str, Path], name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built[name])
    model = AutoModelForCausalLM.from_pretrained(built[name])
    config = model.config
    assert type(model).__name__ == PRESETS[name].architecture
    assert config.vocab_size == len(tokenizer) == make_model.TINY_VOCAB
    assert config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.bos_token_id == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.dtype == torch.float32
    assert config.tie_word_embeddings == PRESETS[name].tie_word_embeddings


@pytest.mark.parametrize("name", TINY)
def test_config_json_has_gqa_and_legacy_keys(built: dict[str, Path], name: str) -> None:
    config = json.loads((built[name] / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["rope_theta"] == 10000.0  # top-level, for loaders older than transformers 5
    assert config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == 2
    weights = load_file(built[name] / "model.safetensors")
    k_proj = weights["model.layers.0.self_attn.k_proj.weight"]
    assert k_proj.shape == (config["num_key_value_heads"] * config["head_dim"], config["hidden_size"])


def test_generation_config_is_greedy(built: dict[str, Path]) -> None:
    generation = json.loads((built["tiny-llama"] / "generation_config.json").read_text())
    assert generation["do_sample"] is False
    assert generation["eos_token_id"] == 2
    assert not {"temperature", "top_p", "top_k"} & generation.keys()


def test_tied_presets_store_no_lm_head(built: dict[str, Path]) -> None:
    assert "lm_head.weight" not in load_file(built["tiny-qwen3"] / "model.safetensors")
    assert "lm_head.weight" in load_file(built["tiny-llama"] / "model.safetensors")


def test_qwen2_biases_are_nonzero(built: dict[str, Path]) -> None:
    weights = load_file(built["tiny-qwen2"] / "model.safetensors")
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = weights[f"model.layers.1.self_attn.{proj}.bias"]
        assert bias.abs().min() > 0 and bias.std() > 0.1, proj


def test_qwen3_norm_weights_are_not_ones(built: dict[str, Path]) -> None:
    weights = load_file(built["tiny-qwen3"] / "model.safetensors")
    for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm"):
        weight = weights[f"model.layers.0.{norm}.weight"]
        assert not torch.allclose(weight, torch.ones_like(weight)), norm


def test_same_preset_builds_identical_bytes(built: dict[str, Path], tmp_path: Path) -> None:
    again = build_model("tiny-qwen2", tmp_path / "again")
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / file).read_bytes() == (built["tiny-qwen2"] / file).read_bytes(), file


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny-llama", tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_chat_template_renders_chatml(built: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built["tiny-qwen2"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "你好"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


@pytest.mark.parametrize("name", TINY)
def test_special_tokens_are_single_ids(built: dict[str, Path], name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built[name])
    for token_id, token in enumerate(make_model.SPECIAL_TOKENS):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("name", TINY)
def test_text_round_trips_and_matches_tokenizer_json(built: dict[str, Path], name: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[name])
    raw = Tokenizer.from_file(str(built[name] / "tokenizer.json"))
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        # transformers 5 rebuilds qwen2 tokenizers itself; the ids must still match tokenizer.json
        assert raw.encode(text).ids == ids


@pytest.mark.parametrize("name", TINY)
def test_greedy_decoding_is_not_degenerate(built: dict[str, Path], name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built[name])
    model = AutoModelForCausalLM.from_pretrained(built[name]).eval()
    outputs = [_greedy(model, tokenizer.encode(p), 12) for p in ("Hello, world", "def main():", "你好")]
    for output in outputs:
        assert len(set(output)) >= 6, output
    assert len({tuple(o) for o in outputs}) == 3


def test_complete_folder_is_kept_and_force_rebuilds(built: dict[str, Path], tmp_path: Path) -> None:
    out = build_model("tiny-llama", tmp_path / "m")
    inode = (out / "model.safetensors").stat().st_ino
    assert build_model("tiny-llama", out) == out
    assert (out / "model.safetensors").stat().st_ino == inode
    build_model("tiny-llama", out, force=True)
    assert (out / "model.safetensors").stat().st_ino != inode
    assert make_model.is_complete(out, "tiny-llama")
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp folders left behind


def test_folder_of_another_preset_is_rebuilt(tmp_path: Path) -> None:
    out = build_model("tiny-llama", tmp_path / "m")
    build_model("tiny-mistral", out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "mistral"


def test_foreign_folder_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_model("tiny-llama", tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_losing_a_race_keeps_the_winner(tmp_path: Path) -> None:
    # Two builds finish; the second rename finds the first in place and must keep it.
    out = tmp_path / "m"
    winner = build_model("tiny-llama", tmp_path / "winner")
    loser = build_model("tiny-llama", tmp_path / "loser")
    winner.rename(out)
    inode = (out / "model.safetensors").stat().st_ino
    make_model._install(loser, out, "tiny-llama", force=False)
    assert (out / "model.safetensors").stat().st_ino == inode
    assert make_model.is_complete(out, "tiny-llama")


def test_ensure_model_uses_cache_dir_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ensure_model("tiny-llama", tmp_path / "a") == tmp_path / "a" / "tiny-llama"
    monkeypatch.setenv("TOKENMILL_MODEL_CACHE", str(tmp_path / "b"))
    path = ensure_model("tiny-llama")
    assert path == tmp_path / "b" / "tiny-llama" and make_model.is_complete(path, "tiny-llama")


def test_unknown_preset_names_it_and_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model") as info:
        build_model("no-such-model", tmp_path / "x")
    assert all(name in str(info.value) for name in PRESETS)
    with pytest.raises(ValueError, match="no-such-model"):
        ensure_model("no-such-model", tmp_path)
    assert not (tmp_path / "x").exists()


def test_invalid_preset_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        make_model.Preset(
            "LlamaForCausalLM",
            tokenizer_vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=3,
            head_dim=32,
            tie_word_embeddings=False,
            seed=0,
        )


def test_large_presets_have_the_real_shapes() -> None:
    bench, qwen = PRESETS["bench-135m"], PRESETS["qwen25-05b-shape"]
    assert (bench.hidden_size, bench.num_hidden_layers, bench.num_key_value_heads) == (576, 30, 3)
    assert bench.dtype == "bfloat16" and bench.config_vocab_size == make_model.BENCH_VOCAB
    assert qwen.config_vocab_size == 151936 > qwen.tokenizer_vocab_size


def test_cli_prints_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make_model.main(["tiny-llama", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert make_model.is_complete(tmp_path / "cli", "tiny-llama")
