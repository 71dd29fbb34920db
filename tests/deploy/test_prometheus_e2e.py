"""End to end: a real Prometheus on loopback scrapes a real tokenmill (tiny model) every second, with
the repo's rule files loaded, while a short load runs (successes, 429s, a timeout, a client that
leaves). Then every dashboard query, every rule and every autoscaler query goes through Prometheus'
HTTP API: each must parse and evaluate, every rule must evaluate without error, and every dashboard
panel must return data (with the Series variable on tokenmill_ and on vllm:). vLLM production-stack's
TTFT p99 and token throughput queries get data. `promtool check metrics` lints a real scrape."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest
import yaml

from tests.server.helpers import ControlledEngine, build_real_engine, make_settings, run_server, wait_until

from .conftest import DASHBOARD, DEPLOY, RULE_FILES, find_tool, rules

SCRAPE_S = 1
RATE_WINDOW = "1m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A prometheus process on a loopback port, with our rule files, scraping one target."""

    def __init__(self, binary: str, target: str, workdir) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [{
                "job_name": "tokenmill",
                # The label a ServiceMonitor adds, so the KEDA queries find the series.
                "static_configs": [{"targets": [target], "labels": {"namespace": "tokenmill"}}],
            }],
        }  # fmt: skip
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.logfile = workdir / "prometheus.log"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited {self.proc.returncode}:\n{self.logfile.read_text()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> dict:
        r = httpx.post(f"{self.url}/api/v1/query", data={"query": expr, "time": f"{time.time():.3f}"}, timeout=10)
        return r.json()

    def value(self, expr: str) -> float | None:
        body = self.query(expr)
        result = body.get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def drive_load(url: str) -> int:
    """A few dozen requests: a burst that overflows the interactive lane (429s), standard requests
    that share a long prefix (prefix-cache hits), streams, batch work, one total timeout and one
    client that leaves. Returns how many requests were sent."""
    shared = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 3

    def post(body: dict, timeout: float = 60) -> int:
        try:
            return httpx.post(f"{url}/generate", json={"stream": False, **body}, timeout=timeout).status_code
        except httpx.ReadTimeout:
            return 0  # the client left

    def stream(body: dict) -> int:
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
            r.read()
            return r.status_code

    jobs = [(post, {"prompt": f"Hello {i}", "max_tokens": 6, "priority": "interactive"}) for i in range(16)]
    jobs += [(post, {"prompt": shared + str(i), "max_tokens": 12, "ignore_eos": True, "priority": "standard"})
             for i in range(6)]  # fmt: skip
    jobs += [(stream, {"prompt": shared, "max_tokens": 12, "ignore_eos": True, "priority": "standard"})] * 4
    jobs += [(post, {"prompt": f"batch {i}", "max_tokens": 8, "priority": "batch"}) for i in range(4)]
    jobs += [(post, {"prompt": "slow", "max_tokens": 300, "ignore_eos": True, "timeout_s": 0.1})]
    with ThreadPoolExecutor(max_workers=len(jobs) + 1) as pool:
        leaver = pool.submit(post, {"prompt": "leaves", "max_tokens": 300, "ignore_eos": True}, 0.3)
        codes = list(pool.map(lambda job: job[0](job[1]), jobs)) + [leaver.result()]
    assert 429 in codes and 200 in codes and 0 in codes, codes
    # A deterministic request twice: a response-cache miss, then a hit.
    faq = {"prompt": "What is tokenmill?", "max_tokens": 4, "temperature": 0.0, "priority": "batch"}
    codes += [post(faq), post(faq)]
    assert codes[-2:] == [200, 200], codes
    return len(codes)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus_bin = find_tool("prometheus")
    from engine.testing.make_model import ensure_model

    # Four seats: the shared-prefix requests cannot all start in one step, so later ones hit the cache.
    engine = ControlledEngine(build_real_engine(str(ensure_model("tiny-llama")), max_num_seqs=4), step_delay_s=0.01)
    settings = make_settings(interactive_max_queued_requests=3, short_request_tokens=64, response_cache_bytes="1MiB")
    with run_server(settings, engine) as srv:
        prom = Prometheus(prometheus_bin, srv.url.removeprefix("http://"), tmp_path_factory.mktemp("prometheus"))
        try:
            wait_until(prom.ready, timeout=30, interval=0.2, what="prometheus ready")
            wait_until(lambda: prom.value('up{job="tokenmill"}') == 1, timeout=15, interval=0.2, what="first scrape")
            sent = drive_load(srv.url)
            srv.wait_idle()
            done = time.time()
            # Every request is counted once Prometheus has scraped after the load ...
            wait_until(lambda: prom.value('sum(tokenmill_requests_total{job="tokenmill"})') == sent, timeout=20,
                       interval=0.2, what="a scrape after the load")  # fmt: skip
            # ... and every rule group evaluated at least once on that data.
            wait_until(lambda: all(_evaluated_after(r, done) for r in _rule_states(prom)), timeout=20, interval=0.2,
                       what="rules evaluated after the load")  # fmt: skip
            yield srv, prom
        finally:
            prom.stop()


def _rule_states(prom: Prometheus) -> list[dict]:
    body = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()
    return [rule for group in body["data"]["groups"] for rule in group["rules"]]


def _evaluated_after(rule: dict, t: float) -> bool:
    stamp = rule.get("lastEvaluation", "")
    if not stamp or stamp.startswith("0001"):
        return False
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp() > t


def substitute(expr: str, series: str = "tokenmill_") -> str:
    """A dashboard query as Grafana sends it, with this test's variable values (`series`: the Series
    variable, tokenmill_ or vllm:)."""
    out = expr.replace("$__rate_interval", RATE_WINDOW).replace("$job", "tokenmill").replace("$instance", ".*")
    out = out.replace("$tenant", ".*")
    out = out.replace("${prefix}", series)
    assert "$" not in out, out
    return out


def finite_values(body: dict) -> list[float]:
    result = body["data"]["result"]
    values = [float(r["value"][1]) for r in result] if body["data"]["resultType"] == "vector" else []
    return [v for v in values if math.isfinite(v)]


@pytest.mark.parametrize("series", ["tokenmill_", "vllm:"])
def test_every_dashboard_panel_returns_data(stack, series):
    _, prom = stack
    dashboard = json.loads(DASHBOARD.read_text())
    empty, errors, seen = [], [], {}
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        values = []
        for target in panel["targets"]:
            body = prom.query(substitute(target["expr"], series))
            if body["status"] != "success":
                errors.append(f"{panel['title']}: {body.get('error')}: {target['expr']}")
                continue
            values += finite_values(body)
        seen[panel["title"]] = values
        if not values:
            empty.append(panel["title"])
    assert errors == [] and empty == []
    # The load's outcomes show where they should.
    assert max(seen["429/s by lane"]) > 0
    assert max(seen["Tenant 429/s by reason"]) > 0  # the lane's 429s, charged to the default tenant
    assert max(seen["Timeouts and cancellations/s"]) > 0
    assert max(seen["Prefix cache hit rate"]) > 0
    assert seen["Replicas up"] == [1.0]
    assert all(0 < v < 1 for v in seen["Device memory"])


def test_dashboard_variables_resolve(stack):
    _, prom = stack
    dashboard = json.loads(DASHBOARD.read_text())
    for var in (v for v in dashboard["templating"]["list"] if v["type"] == "query"):
        match = var["query"]["query"]  # label_values(<selector>, <label>) -> the series API
        selector, label = match.removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        r = httpx.get(f"{prom.url}/api/v1/series", params={"match[]": substitute(selector)}, timeout=10).json()
        assert r["status"] == "success" and {s[label] for s in r["data"]}, var["name"]


def test_every_rule_parses_and_evaluates_without_error(stack):
    _, prom = stack
    for rule in rules():
        body = prom.query(rule["expr"])
        assert body["status"] == "success", (rule.get("alert") or rule["record"], body.get("error"))
    states = _rule_states(prom)
    assert len(states) == len(rules())
    assert [(r["name"], r.get("lastError")) for r in states if r["health"] != "ok"] == []
    # Thresholds are recorded; nothing fires on a healthy server (the stall alert included: work ran).
    assert prom.value("tokenmill:threshold:stall_seconds") == 30
    firing = prom.query('ALERTS{alertstate="firing"}')["data"]["result"]
    assert firing == []


def test_autoscaler_queries_evaluate(stack):
    _, prom = stack
    scaled = yaml.safe_load((DEPLOY / "k8s" / "scaledobject.yaml").read_text())
    for trigger in scaled["spec"]["triggers"]:
        body = prom.query(trigger["metadata"]["query"])
        assert body["status"] == "success" and finite_values(body), trigger["name"]


# What a KEDA ScaledObject written for vLLM (llm-d's, the Gateway API Inference Extension's recipes) asks:
# requests waiting (lanes included) plus running, per replica, and the KV cache in use.
VLLM_STYLE_QUERIES = (
    'sum(vllm:num_requests_waiting{namespace="tokenmill", model_name="tiny-llama"})',
    'sum(vllm:num_requests_waiting{namespace="tokenmill"}) + sum(vllm:num_requests_running{namespace="tokenmill"})',
    'max(vllm:kv_cache_usage_perc{namespace="tokenmill"})',
    'max by (model_name) (max_over_time(vllm:num_requests_waiting{namespace="tokenmill"}[5m]))',
    'count(vllm:cache_config_info{namespace="tokenmill", block_size!=""})',
)


def test_vllm_named_autoscaler_queries_evaluate(stack):
    _, prom = stack
    for query in VLLM_STYLE_QUERIES:
        body = prom.query(query)
        assert body["status"] == "success" and finite_values(body), query
    assert prom.value(VLLM_STYLE_QUERIES[-1]) == 1


# vLLM production-stack's dashboard (and vLLM's own Grafana example): TTFT p99 and token throughput.
PRODUCTION_STACK_QUERIES = {
    "ttft_p99": f"histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket[{RATE_WINDOW}])))",
    "generation_tps": f"sum(rate(vllm:generation_tokens_total[{RATE_WINDOW}]))",
    "prompt_tps": f"sum(rate(vllm:prompt_tokens_total[{RATE_WINDOW}]))",
    "itl_p50": f"histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket[{RATE_WINDOW}])))",
    "e2e_p99": f"histogram_quantile(0.99, sum by(le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket[{RATE_WINDOW}])))",
    "success_rps": f"sum by (finished_reason) (rate(vllm:request_success_total[{RATE_WINDOW}]))",
}


def test_vllm_production_stack_queries_get_data(stack):
    _, prom = stack
    got = {name: finite_values(prom.query(q)) for name, q in PRODUCTION_STACK_QUERIES.items()}
    assert all(got.values()), got
    assert 0 < got["ttft_p99"][0] <= 2560 and got["generation_tps"][0] > 0 and got["prompt_tps"][0] > 0
    # The same facts as ours, evaluated at one instant: token and first-token rates equal tokenmill's
    # (the quantiles differ only by bucket edges).
    for ours, theirs in (("tokenmill_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("tokenmill_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count")):
        diff = f"sum(rate({theirs}[{RATE_WINDOW}])) - sum(rate({ours}[{RATE_WINDOW}]))"
        assert finite_values(prom.query(diff)) == [pytest.approx(0.0, abs=1e-9)], diff
    labels = prom.query("vllm:time_to_first_token_seconds_count")["data"]["result"][0]["metric"]
    assert labels["model_name"] == "tiny-llama" and labels["engine"] == "0"


def test_promtool_check_metrics_on_a_real_scrape(stack, promtool):
    srv, _ = stack
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert "tokenmill_request_rejections_total" in text
    # vLLM's names carry a colon by design (routers read them so); promtool's lint is for the names we chose.
    assert "vllm:num_requests_waiting{" in text
    text = "".join(line for line in text.splitlines(keepends=True)
                   if not line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith("vllm:"))
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
