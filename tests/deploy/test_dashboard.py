"""grafana/: the dashboard JSON is well formed, has the panels the docs promise, and fresh Grafana loads
it with no clicks (data source and dashboard provider provisioned at the paths docker-compose mounts).
Its queries are run against a real Prometheus in test_prometheus_e2e.py."""

from __future__ import annotations

import json

from .conftest import DASHBOARD, REPO, load_yaml

GRAFANA = REPO / "grafana"
DS = {"type": "prometheus", "uid": "${datasource}"}
SERIES = "${prefix}"  # the Series variable: tokenmill_* or vLLM's vllm:* names
# Panels that switch to vLLM's series (vllm:x has the same name after the prefix as tokenmill_x).
SWITCHED = ["Output tokens/s", "Time to first token p50 / p99 by lane", "Inter-token latency p50 / p99",
            "End-to-end latency p99 by lane", "Queue wait p99 by lane", "Running batch size", "Tokens/s",
            "Prompt and generation length p50 / p99", "KV cache usage", "Prefix cache hit rate"]

# The panel list -> the panel title that answers it.
REQUIRED = [
    "Time to first token p50 / p99 by lane",
    "Inter-token latency p50 / p99",
    "End-to-end latency p99 by lane",
    "Tokens/s",  # output and prompt
    "Requests/s by status",
    "429/s by lane",
    "Error rate",
    "Queue depth by lane",
    "Queue wait p99 by lane",
    "Running batch size",
    "KV cache usage",
    "Prefix cache hit rate",
    "Preemptions/s by lane and cause",
    "Step time by phase p50 / p99",
    "Device memory",
    "Seconds since last step",
    # tenants (docs/OPERATIONS.md "Tenants"): a row repeated per tenant
    "Tenant requests/s",
    "Tenant tokens/s",
    "Tenant 429/s by reason",
    "Tenant queue wait p99",
]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_has_every_promised_panel():
    titles = [p["title"] for p in panels()]
    assert [t for t in REQUIRED if t not in titles] == []
    tokens = next(p for p in panels() if p["title"] == "Tokens/s")
    assert {t["legendFormat"] for t in tokens["targets"]} == {"output", "prompt"}


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] == "tokenmill-overview" and d["title"] and isinstance(d["schemaVersion"], int)
    assert "id" not in d or d["id"] is None  # provisioned dashboards get their id from Grafana
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    rows = [p for p in d["panels"] if p["type"] == "row" and p.get("repeat")]
    assert [r["repeat"] for r in rows] == ["tenant"]  # one row per tenant
    for name in ("job", "instance", "tenant"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_every_panel_queries_the_selected_prometheus():
    for p in panels():
        assert p["datasource"] == DS and p["description"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            assert t["datasource"] == DS and t["expr"].strip()
            # Every selector honours the job and instance variables, so one dashboard serves many fleets.
            expr = t["expr"].replace(SERIES, "")
            assert expr.count("{") == expr.count('job=~"$job", instance=~"$instance"'), t["expr"]
            if "rate(" in t["expr"]:
                assert "[$__rate_interval]" in t["expr"], t["expr"]


def test_the_series_variable_switches_to_vllm_names():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    series = variables["prefix"]
    assert series["type"] == "custom" and not series["multi"] and not series["includeAll"]
    assert [o["value"] for o in series["options"]] == series["query"].split(",") == ["tokenmill_", "vllm:"]
    assert series["current"]["value"] == "tokenmill_"  # ours by default
    uses = [p["title"] for p in panels() if any(SERIES in t["expr"] for t in p["targets"])]
    assert uses == SWITCHED  # each returns data with either value: test_prometheus_e2e.py


def test_provisioning_loads_the_dashboard_without_clicks():
    sources = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    (prom,) = sources["datasources"]
    assert prom["type"] == "prometheus" and prom["isDefault"] and prom["url"] == "http://prometheus:9090"
    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "tokenmill.yml")
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    # docker-compose.yml mounts grafana/dashboards at the provider's path, and provisioning at Grafana's.
    grafana = load_yaml(REPO / "docker-compose.yml")["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
