"""bench gemv: every decode-step shape of the model at every row count, three variants each."""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from bench.inproc.gemv import model_shapes
from engine.models.cpu_linear import kernels_unavailable


def test_model_shapes_follow_the_config():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576,
                          intermediate_size=1536, vocab_size=49152)
    assert model_shapes(cfg) == [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False),
                                 (49152, 576, False)]


@pytest.mark.skipif(kernels_unavailable("int8") is not None, reason="the linear kernels cannot run here")
def test_gemv_cli_times_every_shape(build_model, tmp_path):
    out = tmp_path / "g.json"
    assert main(["gemv", "--model", str(build_model("tiny-llama")), "--rows", "1", "3", "--layers", "2",
                 "--repeats", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res) == 5 * 2 and [r["rows"] for r in res[:2]] == [1, 3]
    assert any("(silu)" in r["shape"] for r in res)
    for r in res:
        assert min(r["onednn_us"], r["bf16_us"], r["int8_us"]) > 0
        assert abs(r["bf16_speedup"] - r["onednn_us"] / r["bf16_us"]) < 1e-9
