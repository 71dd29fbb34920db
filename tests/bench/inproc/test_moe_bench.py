"""bench moe: an MoE model's decode step against the floor of its active weights (top-k experts per
sparse layer); the active bytes are the model's linears with each layer's experts cut to top_k / E."""

from __future__ import annotations

import json

from bench.cli import main
from bench.inproc.floor import decode_engine
from bench.inproc.moe import total_bytes
from engine.models.moe import SparseMoeBlock


def test_active_bytes_are_top_k_of_each_layers_experts(build_model):
    engine = decode_engine(str(build_model("tiny-olmoe")), "bfloat16", batch=1, context=8, max_tokens=4)
    model = engine.runner.model
    active = engine.weights.weight_bytes
    total, experts, top_k = total_bytes(model, active)
    assert (experts, top_k) == (8, 2)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    per_expert = sum(m.weight.numel() * 2 for m in (blocks[0].experts.gate_up[0], blocks[0].experts.down[0]))
    assert total - active == len(blocks) * per_expert * (experts - top_k)


def test_moe_cli_reports_the_floor_ratio(build_model, tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["moe", "--model", str(build_model("tiny-olmoe")), "--steps", "3", "--context", "8",
                 "--threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["experts"] == 8 and r["top_k"] == 2 and 0 < r["active_bytes"] < r["total_bytes"]
    assert len(r["steps_ms"]) == 3 and r["ratio"] > 0 and "x the floor" in capsys.readouterr().out
