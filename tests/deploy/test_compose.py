"""docker-compose.yml, checked by docker-compose itself (no Docker engine needed) and read back:
GPU reservation, config from the environment, models and cache volumes, healthchecks, Prometheus and
Grafana wiring, and the `replicas` profile behind nginx."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from server.config.settings import ENV_PREFIX, ServerSettings

from .conftest import DEPLOY, REPO, find_tool, load_yaml

ENV = {"TOKENMILL_MODEL": "/models/Qwen2.5-1.5B-Instruct", "TOKENMILL_MAX_NUM_SEQS": "32"}


@pytest.fixture(scope="module")
def compose() -> str:
    return find_tool("docker-compose")


def config(compose: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    return subprocess.run([compose, "-f", "docker-compose.yml", *args, "config"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})})  # fmt: skip


@pytest.fixture(scope="module")
def resolved(compose) -> dict:
    proc = config(compose, "--profile", "replicas", env=ENV)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_compose_file_is_valid_with_and_without_the_replicas_profile(compose):
    for args in ((), ("--profile", "replicas")):
        proc = config(compose, *args, env=ENV)
        assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    # A plain `up` starts one tokenmill with Prometheus and Grafana; the profile adds the rest.
    assert {name for name, svc in services.items() if not svc.get("profiles")} == {"tokenmill", "prometheus", "grafana"}
    assert {name for name, svc in services.items() if svc.get("profiles") == ["replicas"]} == {"tokenmill-2", "nginx"}


def test_the_model_must_be_named(compose):
    proc = config(compose, env={})
    assert proc.returncode != 0 and "set TOKENMILL_MODEL" in proc.stderr


def test_tokenmill_service_gets_a_gpu_its_config_models_and_a_healthcheck(resolved):
    for name, gpu in (("tokenmill", "0"), ("tokenmill-2", "1")):
        svc = resolved["services"][name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["device_ids"] == [gpu]
        env = svc["environment"]
        assert env["TOKENMILL_MODEL"] == ENV["TOKENMILL_MODEL"] and env["TOKENMILL_MAX_NUM_SEQS"] == "32"
        assert env["TOKENMILL_DTYPE"] is None  # unset: the container does not get it, the config file decides
        assert any(v.endswith(":/models:ro") for v in svc["volumes"])
        assert "model-cache:/cache:rw" in svc["volumes"]
        assert "http://127.0.0.1:8000/health" in " ".join(svc["healthcheck"]["test"])
        assert svc["stop_grace_period"] == "45s"
    ports = resolved["services"]["tokenmill"]["ports"]
    assert ports == ["127.0.0.1:8000:8000/tcp"]  # the host's loopback unless TOKENMILL_BIND says otherwise
    assert "ports" not in resolved["services"]["tokenmill-2"]


def test_every_environment_variable_is_a_setting():
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in ServerSettings.model_fields}
    env = load_yaml(REPO / "docker-compose.yml")["x-tokenmill"]["environment"]
    assert set(env) - fields == set()


def test_prometheus_and_grafana_are_wired(resolved):
    prom = resolved["services"]["prometheus"]
    assert f"{DEPLOY / 'prometheus'}:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    scrape = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert scrape["rule_files"] == ["rules/*.yml"]
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "tokenmill")
    replicas = {name for name, svc in resolved["services"].items() if name.startswith("tokenmill")}
    assert set(job["dns_sd_configs"][0]["names"]) == replicas
    assert resolved["services"]["grafana"]["depends_on"] == {"prometheus": {"condition": "service_started"}}


def test_replicas_profile_runs_two_tokenmills_behind_nginx(resolved):
    nginx = resolved["services"]["nginx"]
    assert nginx["profiles"] == ["replicas"] and resolved["services"]["tokenmill-2"]["profiles"] == ["replicas"]
    assert nginx["depends_on"] == {name: {"condition": "service_healthy"} for name in ("tokenmill", "tokenmill-2")}
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    directives = [line.split("#")[0].strip() for line in conf.splitlines()]
    upstream = re.search(r"upstream tokenmill \{(.*?)\}", conf, re.S).group(1)
    assert "least_conn;" in upstream
    assert re.findall(r"server (\S+):8000", upstream) == ["tokenmill", "tokenmill-2"]
    for line in ("proxy_buffering off;", "proxy_cache off;", "proxy_http_version 1.1;",
                 "proxy_request_buffering on;", "proxy_next_upstream_tries 2;"):
        assert line in directives, line
    # Retry on another replica only for answers given before the request started: never on error/timeout.
    (retry,) = [d for d in directives if d.startswith("proxy_next_upstream ")]
    assert retry == "proxy_next_upstream http_429 http_503 non_idempotent;"
