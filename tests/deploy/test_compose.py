"""docker-compose.yml and its GPU override docker-compose.gpu.yml, checked by docker-compose itself (no
Docker engine needed) and read back: the CPU image by default and the GPU image with a GPU per service
through the override, the image built once, config from the environment, models and cache volumes,
healthchecks, Prometheus and Grafana wiring, and the `replicas` profile behind vllm-router. Bringing the
stack up: deploy/docker/smoke.sh (make docker-smoke)."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from server.config.settings import ENV_PREFIX, ServerSettings

from .conftest import DEPLOY, REPO, find_tool, load_yaml

ENV = {"TOKENMILL_MODEL": "/models/Qwen2.5-1.5B-Instruct", "TOKENMILL_MAX_NUM_SEQS": "32"}


@pytest.fixture(scope="module")
def compose() -> str:
    return find_tool("docker-compose")


GPU = ("-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml")


def config(compose: str, *args: str, env: dict[str, str] | None = None, files=("-f", "docker-compose.yml")):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k != "COMPOSE_FILE"}
    return subprocess.run([compose, *files, *args, "config"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})})  # fmt: skip


def resolve(compose: str, files: tuple[str, ...], env: dict[str, str] | None = ENV) -> dict:
    proc = config(compose, "--profile", "replicas", env=env, files=files)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def resolved(compose) -> dict:
    """The stack on a GPU host: the base file and the GPU override."""
    return resolve(compose, GPU)


@pytest.fixture(scope="module")
def resolved_cpu(compose) -> dict:
    return resolve(compose, ("-f", "docker-compose.yml"))


def test_compose_files_are_valid_with_and_without_the_replicas_profile(compose):
    for files in (("-f", "docker-compose.yml"), GPU):
        for args in ((), ("--profile", "replicas")):
            proc = config(compose, *args, env=ENV, files=files)
            assert proc.returncode == 0, proc.stderr
        services = yaml.safe_load(proc.stdout)["services"]
        # A plain `up` starts one tokenmill with Prometheus and Grafana; the profile adds the rest.
        assert {name for name, svc in services.items() if not svc.get("profiles")} == {"tokenmill", "prometheus", "grafana"}
        assert {name for name, svc in services.items() if svc.get("profiles") == ["replicas"]} == {"tokenmill-2", "router"}


def test_a_cpu_host_needs_no_switch_and_no_model(compose, resolved_cpu):
    """`docker compose up` on a CPU host: the CPU image, no GPU asked for, the image's own model."""
    for name in ("tokenmill", "tokenmill-2"):
        svc = resolved_cpu["services"][name]
        assert svc["image"] == "tokenmill:cpu" and "deploy" not in svc
    assert resolved_cpu["services"]["tokenmill"]["build"]["args"] == {"VARIANT": "cpu"}
    bare = resolve(compose, ("-f", "docker-compose.yml"), env={})
    env = bare["services"]["tokenmill"]["environment"]
    assert env["TOKENMILL_MODEL"] is None and env["TOKENMILL_CONFIG"] is None  # unset: the image decides


def test_the_gpu_override_is_the_one_documented_switch(resolved):
    deploy_md = (REPO / "docs" / "DEPLOY.md").read_text()
    assert "docker-compose.gpu.yml" in deploy_md and "COMPOSE_FILE=docker-compose.yml:docker-compose.gpu.yml" in deploy_md
    assert resolved["services"]["tokenmill"]["build"]["args"] == {"VARIANT": "gpu"}
    assert {resolved["services"][n]["image"] for n in ("tokenmill", "tokenmill-2")} == {"tokenmill:gpu"}


def test_the_image_is_built_once(resolved, resolved_cpu):
    for stack in (resolved, resolved_cpu):
        tokenmills = {n: s for n, s in stack["services"].items() if n.startswith("tokenmill")}
        assert [n for n, s in tokenmills.items() if "build" in s] == ["tokenmill"]
        assert len({s["image"] for s in tokenmills.values()}) == 1
    # compose v2 must not try to pull the image tokenmill-2 shares (it is on no registry); v1 builds in
    # dependency order
    base = load_yaml(REPO / "docker-compose.yml")["services"]["tokenmill-2"]
    assert base["pull_policy"] == "never" and base["depends_on"] == ["tokenmill"]


def test_the_models_folder_is_in_the_repository():
    # mounted by default: Docker would create a missing one, owned by root
    tracked = subprocess.run(["git", "ls-files", "models"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert tracked == ["models/README.md"]
    assert "${TOKENMILL_MODELS_DIR:-./models}:/models:ro" in load_yaml(REPO / "docker-compose.yml")["x-tokenmill"]["volumes"]


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


def test_replicas_profile_runs_two_tokenmills_behind_vllm_router(resolved):
    router = resolved["services"]["router"]
    assert router["profiles"] == ["replicas"] and resolved["services"]["tokenmill-2"]["profiles"] == ["replicas"]
    assert router["depends_on"] == {name: {"condition": "service_healthy"} for name in ("tokenmill", "tokenmill-2")}
    # its own image, from deploy/router/Dockerfile (the registry's wheel), never tokenmill's
    assert router["build"]["dockerfile"] == "deploy/router/Dockerfile" and router["image"] == "tokenmill-router:0.1.17"
    cmd = router["command"]

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://tokenmill:8000",
                                                                                  "http://tokenmill-2:8000"]
    assert flag("--policy") == "cache_aware"  # TOKENMILL_ROUTER_POLICY unset
    # readiness, checked often enough that a draining replica (drain_timeout_s 30) leaves before it stops
    assert flag("--health-check-endpoint") == "/health" and int(flag("--health-check-interval-secs")) <= 5
    assert flag("--health-failure-threshold") == "1"
    assert int(flag("--max-payload-size")) == ServerSettings().max_body_bytes
    assert router["ports"] == ["127.0.0.1:8080:8080/tcp"]
    assert not (DEPLOY / "nginx").exists()


def test_the_router_policy_comes_from_the_environment(compose):
    stack = resolve(compose, ("-f", "docker-compose.yml"), env={**ENV, "TOKENMILL_ROUTER_POLICY": "round_robin"})
    cmd = stack["services"]["router"]["command"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"


KV = ("-f", "docker-compose.yml", "-f", "docker-compose.kv-events.yml")


def test_the_kv_events_override_runs_the_router_on_kv_aware(compose):
    stack = resolve(compose, KV)
    env = {name: stack["services"][name]["environment"] for name in ("tokenmill", "tokenmill-2")}
    for e in env.values():
        cfg = ServerSettings(kv_events_config=e["TOKENMILL_KV_EVENTS_CONFIG"], block_size=int(e["TOKENMILL_BLOCK_SIZE"]))
        assert cfg.kv_events().enable_kv_cache_events and cfg.kv_events().endpoint == "tcp://*:5557"
        assert e["TOKENMILL_MODEL"] == ENV["TOKENMILL_MODEL"]  # the base file's settings still pass through
    router = stack["services"]["router"]
    cmd = router["command"]
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    assert sources == ["http://tokenmill:8000=tcp://tokenmill:5557", "http://tokenmill-2:8000=tcp://tokenmill-2:5557"]
    assert cmd[cmd.index("--kv-event-block-size") + 1] == env["tokenmill"]["TOKENMILL_BLOCK_SIZE"]
    # the router reads the tokenizer from the replicas' model folder, mounted at the same path
    assert cmd[cmd.index("--kv-event-model") + 1] == ENV["TOKENMILL_MODEL"]
    assert any(v.endswith(":/models:ro") for v in router["volumes"])


def test_the_kv_events_override_needs_a_model_folder(compose):
    proc = config(compose, "--profile", "replicas", env={}, files=KV)
    assert proc.returncode != 0 and "kv_aware needs TOKENMILL_MODEL" in proc.stderr
