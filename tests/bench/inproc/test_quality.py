"""bench quality: teacher-forced logits through the engine, perplexity, top-1 agreement, the gate."""

from __future__ import annotations

import json
import math

import torch

from bench.cli import main
from bench.inproc.quality import DEFAULT_TEXT, make_engine, measure, perplexity, prompt_logits
from engine import SamplingParams


def test_perplexity_of_known_logits():
    ids = [3, 1, 4, 1]
    assert abs(perplexity(torch.zeros(4, 10), ids) - 10.0) < 1e-5  # uniform over 10 tokens
    sure = torch.full((4, 10), -1e4)
    sure[0, 1] = sure[1, 4] = sure[2, 1] = 0.0  # each next token certain
    assert abs(perplexity(sure, ids) - 1.0) < 1e-5


def test_prompt_logits_match_the_engines_own_next_token(build_model):
    engine = make_engine(str(build_model("tiny-llama")), "float32", None, 40, "off")
    ids = list(range(20, 60))
    logits = prompt_logits(engine, ids)
    assert logits.shape == (40, engine.vocab_size) and logits.dtype == torch.float32
    for n in (1, 17, 40):  # the logits at position n - 1 predict what generate() samples after ids[:n]
        fresh = make_engine(str(build_model("tiny-llama")), "float32", None, 40, "off")
        out = fresh.generate([ids[:n]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))[0]
        assert out.token_ids[0] == int(logits[n - 1].argmax())
        assert abs(out.logprobs[0].logprob - float(torch.log_softmax(logits[n - 1], -1)[out.token_ids[0]])) < 1e-4


def test_quality_cli_reports_and_gates(build_model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(DEFAULT_TEXT.read_text()[:600])
    out = tmp_path / "q.json"
    rc = main(["quality", "--model", str(build_model("tiny-llama")), "--text", str(text), "--json", str(out)])
    r = json.loads(out.read_text())
    assert 0.0 <= r["top1_agreement"] <= 1.0 and r["tokens"] > 50
    assert math.isclose(r["ppl_change"], r["ppl_candidate"] / r["ppl_reference"] - 1)
    assert r["passed"] == (r["top1_agreement"] >= 0.95 and abs(r["ppl_change"]) <= 0.02)
    assert rc == (0 if r["passed"] else 1)
    assert r["weight_bytes_candidate"] < 0.6 * r["weight_bytes_reference"]  # INT8 against bf16


def test_same_weights_pass_the_gate(build_model):
    """The gate compares like with like: bf16 against itself agrees everywhere."""
    import bench.inproc.quality as quality

    r = measure(str(build_model("tiny-qwen2")), DEFAULT_TEXT.read_text()[:400], "bfloat16", "int8", "off")
    assert r.candidate == "bfloat16 + int8 g64" and r.tokens > 30
    original = quality.make_engine
    try:
        quality.make_engine = lambda model, dtype, q, tokens, gemv, group=None: original(model, dtype, None, tokens, "off")
        same = measure(str(build_model("tiny-qwen2")), DEFAULT_TEXT.read_text()[:400], "bfloat16", "int8", "off")
    finally:
        quality.make_engine = original
    assert same.top1_agreement == 1.0 and same.ppl_change == 0.0 and same.passed
