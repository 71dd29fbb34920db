"""bench router: the workload's shape on its own, and one short end-to-end run (two tiny-llama replicas
behind the real vllm-router, round_robin, cache_aware and kv_aware, plus the single-replica reference). No timing
assertions: the report's accounting (every request answered, hits <= lookups, each replica's requests
adding up) is what is checked."""

from __future__ import annotations

import json

from bench.cli import main
from bench.fleet.launcher import router_binary
from bench.fleet.router import build_workload, kv_events_wiring
from tests.ci_skips import skip_or_fail


def test_workload_is_seeded_and_shares_one_prefix_per_tenant():
    a = build_workload(tenants=3, system_words=50, users=6, questions=2, seed=1)
    assert a == build_workload(tenants=3, system_words=50, users=6, questions=2, seed=1)
    assert len(a.systems) == 3 and len(set(a.systems)) == 3 and len(a.requests) == 12
    assert {t for t, _ in a.requests} == {0, 1, 2} and len({q for _, q in a.requests}) == 12
    msgs = a.messages(0)
    assert msgs[0] == {"role": "system", "content": a.systems[a.requests[0][0]]} and msgs[1]["role"] == "user"


def test_a_short_run_reports_every_policy(build_model, tmp_path):
    if router_binary() is None:
        message = "vllm-router is not installed (pip install -e '.[router]')"
        skip_or_fail(message)
    model = build_model("tiny-llama")
    out = tmp_path / "out"
    rc = main(["router", "--model", str(model), "--policies", "single,round_robin,cache_aware,kv_aware", "--tenants", "2",
               "--system-tokens", "120", "--users", "4", "--questions", "2", "--max-tokens", "3",
               "--concurrency", "2", "--out-dir", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "router.json").read_text())
    assert report["workload"]["requests"] == 8 and 80 <= report["workload"]["system_prompt_tokens"] <= 160
    rows = {r["policy"]: r for r in report["results"]}
    assert list(rows) == ["single", "round_robin", "cache_aware", "kv_aware"]
    for policy, row in rows.items():
        assert row["ok"] == row["requests"] == 8, row["errors"]
        assert row["replicas"] == (1 if policy == "single" else 2)
        assert sum(p["requests"] for p in row["per_replica"]) == 8
        for p in row["per_replica"]:
            assert 0 <= p["prefix_hit_tokens"] <= p["prefix_query_tokens"]
        assert 0 < row["hit_rate"] < 1  # the shared system prompts hit; the first of each does not
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["requests_per_s"] > 0
    assert all(p["requests"] > 0 for p in rows["round_robin"]["per_replica"])


def test_kv_events_wiring_binds_on_each_replica_and_connects_the_router():
    per, endpoints = kv_events_wiring(2)
    assert sorted(per) == [0, 1] and len(set(endpoints)) == 2
    for i, endpoint in enumerate(endpoints):
        flag, config = per[i]
        cfg = json.loads(config)
        assert flag == "--kv-events-config" and cfg["enable_kv_cache_events"] and cfg["publisher"] == "zmq"
        # vLLM binds an endpoint with `*` and connects to any other: the replica binds, the router connects
        assert cfg["endpoint"] == endpoint.replace("127.0.0.1", "*")
