"""bench fused: both engines decode the same tokens, and the table has one row per batch size."""

from __future__ import annotations

import json

from bench.cli import main
from tests.engine.helpers import require_cpu_kernels


def test_fused_cli_times_both_loops(build_model, tmp_path):
    require_cpu_kernels()
    out = tmp_path / "f.json"
    assert main(["fused", "--model", str(build_model("tiny-llama")), "--dtype", "float32", "--batch", "1", "3",
                 "--prompt", "20", "--steps", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res] == [1, 3]
    for r in res:
        assert r["tokens_equal"] is True
        assert r["python_ms"] > 0 and r["fused_ms"] > 0
        assert abs(r["speedup"] - r["python_ms"] / r["fused_ms"]) < 0.01
