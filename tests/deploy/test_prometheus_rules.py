"""deploy/prometheus: the scrape config and rule files pass promtool, every alert has a promtool unit
test that fires it, the thresholds are the documented ones, Kubernetes gets the same rules, and every
series a rule or a dashboard panel reads is one tokenmill exposes."""

from __future__ import annotations

import json
import re
import sys

from prometheus_client.parser import text_string_to_metric_families

from engine.api import EngineStats
from server.config.lanes import Lane
from server.ops.memory import DeviceMemory
from server.ops.metrics import CacheStats, ModelInfo, ServerMetrics, Snapshot, VersionSnapshot
from server.ops.tenant_metrics import TenantMetrics

from .conftest import DASHBOARD, DEPLOY, PROM, REPO, RULE_FILES, load_yaml, rules, run

TESTS = sorted((PROM / "tests").glob("*.test.yml"))
DEPLOY_DOC = REPO / "docs" / "DEPLOY.md"
SERIES = re.compile(r"\b(tokenmill_[a-z0-9_]+)")


def test_config_and_rules_pass_promtool_checks(promtool):
    out = run([promtool, "check", "config", "prometheus.yml"], cwd=PROM).stdout
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out
    run([promtool, "check", "rules", *map(str, RULE_FILES)])


def test_alert_unit_tests_pass(promtool):
    assert TESTS
    out = run([promtool, "test", "rules", *(t.name for t in TESTS)], cwd=PROM / "tests").stdout
    assert out.count("SUCCESS") == len(TESTS)


def test_every_alert_has_a_unit_test_that_fires_it():
    alerts = {r["alert"] for r in rules() if "alert" in r}
    fired = set()
    for path in TESTS:
        for case in load_yaml(path)["tests"]:
            fired |= {t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alerts == fired
    assert {"TokenmillTTFTHigh", "TokenmillThroughputLow", "TokenmillDeviceMemoryHigh", "TokenmillQueueWaitHigh",
            "TokenmillErrorRateHigh", "TokenmillEngineStalled", "TokenmillRejectingRequests"} <= alerts


def thresholds(path) -> dict[tuple[str, str | None], str]:
    out = {}
    for group in load_yaml(path)["groups"]:
        for rule in group["rules"]:
            out[(rule["record"], (rule.get("labels") or {}).get("lane"))] = rule["expr"]
    return out


def test_thresholds_are_the_documented_defaults():
    t = thresholds(PROM / "rules" / "tokenmill-thresholds.yml")
    assert t == {
        ("tokenmill:threshold:ttft_p99_seconds", "interactive"): "vector(2)",
        ("tokenmill:threshold:ttft_p99_seconds", "standard"): "vector(2)",
        ("tokenmill:threshold:queue_wait_p99_seconds", "interactive"): "vector(1)",
        ("tokenmill:threshold:queue_wait_p99_seconds", "standard"): "vector(1)",
        ("tokenmill:threshold:generation_tokens_per_second_baseline", None): "vector(0)",
        ("tokenmill:threshold:generation_throughput_min_ratio", None): "vector(0.7)",
        ("tokenmill:threshold:device_memory_ratio", None): "vector(0.9)",
        ("tokenmill:threshold:error_ratio", None): "vector(0.01)",
        ("tokenmill:threshold:stall_seconds", None): "vector(30)",
        ("tokenmill:threshold:rejected_ratio", None): "vector(0.05)",
    }
    # The unit tests' copy differs only by a baseline, so the firing test exercises the real values.
    copy = thresholds(PROM / "tests" / "thresholds-with-baseline.yml")
    baseline = ("tokenmill:threshold:generation_tokens_per_second_baseline", None)
    assert copy.pop(baseline) == "vector(1000)"
    t.pop(baseline)
    assert copy == t


def test_every_alert_uses_a_threshold_that_exists():
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        if "alert" in rule and rule["alert"] not in ("TokenmillWorkerDead", "TokenmillDown"):
            used = set(re.findall(r"tokenmill:threshold:[a-z0-9_]+", rule["expr"]))
            assert used and used <= recorded, rule["alert"]
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["runbook"] == f"docs/DEPLOY.md#{rule['alert'].lower()}"
            assert f"\n### {rule['alert']}\n" in DEPLOY_DOC.read_text(), f"docs/DEPLOY.md explains {rule['alert']}"


def test_kubernetes_prometheusrule_is_rendered_from_the_rule_files():
    sys.path.insert(0, str(DEPLOY / "k8s"))
    try:
        from render_prometheusrule import render
    finally:
        sys.path.pop(0)
    assert (DEPLOY / "k8s" / "prometheusrule.yaml").read_text() == render(), \
        "run: python deploy/k8s/render_prometheusrule.py"


def exposed_series() -> set[str]:
    """Sample names a tokenmill /metrics answer holds once a request finished (built without an engine)."""
    info = ModelInfo("m", "bfloat16", "cuda:0", "v1", 4096)
    snap = Snapshot(EngineStats(), {lane: (0, 0) for lane in Lane}, True, DeviceMemory("cuda:0", 1, 2))
    version = VersionSnapshot(info, "ready", "promoted", 0, snap, 0.0)
    metrics = ServerMetrics("0", lambda: [version], cache_stats=lambda: [CacheStats("m", "v1", 1, 100)])
    metrics.version("m", "v1").observe_finished(Lane.INTERACTIVE, "ok", "stop", (5, 3),
                                                {"queue_s": 0.1, "ttft_s": 0.2, "e2e_s": 0.3})
    TenantMetrics(metrics.registry, ["default"]).observe_choice("default", 5, 3, 0.1, True)  # as the runtime has it
    text = metrics.render().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_rules_dashboard_and_autoscaler_read_only_series_tokenmill_exposes():
    exposed = exposed_series()
    exprs = [r["expr"] for r in rules()]
    dash = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    scaled = load_yaml(DEPLOY / "k8s" / "scaledobject.yaml")
    exprs += [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    used = {name for expr in exprs for name in SERIES.findall(expr)}
    assert used and used - exposed == set()
