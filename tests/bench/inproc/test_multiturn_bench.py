"""bench multiturn: a hybrid model's turn-2 TTFT with state checkpoints and without, on tiny-lfm2 (the
figures themselves are the benchmark's; here: the arms run, turn 2 resumes from a checkpoint only with
them, and both arms give the same tokens)."""

from __future__ import annotations

import json

from bench.cli import main


def test_multiturn_cli_reports_the_turn2_ratio(build_model, tmp_path, capsys):
    out = tmp_path / "multiturn.json"
    assert main(["multiturn", "--model", str(build_model("tiny-lfm2")), "--context", "300", "--answer", "20",
                 "--user", "10", "--max-tokens", "3", "--rounds", "2", "--threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_tokens"] and r["turn2_prompt"] == 310
    # the end of turn 1 (280 + 20 tokens, 299 computed) aligned down to a 32-token block
    assert r["cached_tokens"] == [288, 288] and r["block_size"] == 32
    assert len(r["ttft_on_ms"]) == len(r["ttft_off_ms"]) == 2 and r["ratio"] > 0
    assert "with checkpoints" in capsys.readouterr().out
