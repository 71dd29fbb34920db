"""deploy/k8s: core kinds validate against the Kubernetes schemas (kubernetes-validate --strict); the
CRDs it has no schema for (ServiceMonitor, PrometheusRule, KEDA ScaledObject) and the wiring between
objects are checked here."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from server.config.settings import ServerSettings

from .conftest import DEPLOY, find_tool, load_yaml, run

K8S = DEPLOY / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def validate() -> str:
    return find_tool("kubernetes-validate")


def doc(name: str) -> dict:
    return load_yaml(K8S / name)


def container() -> dict:
    (c,) = doc("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return c


def test_manifests_pass_kubernetes_validate_strict(validate):
    out = run([validate, "--strict", *map(str, MANIFESTS)]).stdout
    for kind in ("deployment/tokenmill", "service/tokenmill", "configmap/tokenmill-config",
                 "poddisruptionbudget/tokenmill", "persistentvolumeclaim/tokenmill-models"):
        assert f"passed for resource {kind}" in out, out


def test_kubernetes_validate_rejects_an_unknown_field(validate, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((K8S / "service.yaml").read_text().replace("type: ClusterIP", "typo: ClusterIP"))
    proc = subprocess.run([validate, "--strict", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "typo" in proc.stdout + proc.stderr


def test_kustomization_lists_every_manifest():
    k = doc("kustomization.yaml")
    assert sorted(k["resources"]) == sorted(p.name for p in MANIFESTS)
    assert k["namespace"] == "tokenmill" and k["images"][0]["name"] == container()["image"]


def test_configmap_is_a_valid_settings_file(tmp_path):
    path = tmp_path / "tokenmill.yaml"
    path.write_text(doc("configmap.yaml")["data"]["tokenmill.yaml"])
    settings = ServerSettings(config=str(path))
    assert settings.host == "0.0.0.0" and settings.device == "cuda"
    env = {e["name"]: e.get("value") for e in container()["env"]}
    assert env["TOKENMILL_CONFIG"] == "/etc/tokenmill/tokenmill.yaml"
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    assert mounts["config"] == "/etc/tokenmill" and mounts["models"] == "/models"


def test_probes_gpu_and_drain():
    c = container()
    spec = doc("deployment.yaml")["spec"]["template"]["spec"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600  # model load
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    config = yaml.safe_load(doc("configmap.yaml")["data"]["tokenmill.yaml"])
    assert spec["terminationGracePeriodSeconds"] >= int(sleep[1]) + config["drain_timeout_s"] + 5
    assert spec["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/cache", "/tmp"}  # writable on a read-only root


def test_service_and_servicemonitor_select_the_pods():
    labels = doc("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    service = doc("service.yaml")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] == container()["ports"][0]["name"]
    monitor = doc("servicemonitor.yaml")
    assert monitor["kind"] == "ServiceMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    pdb = doc("pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_autoscaling_on_load_and_ttft():
    scaled = doc("scaledobject.yaml")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == doc("deployment.yaml")["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]  # never to zero: a model takes minutes to load
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"load", "ttft"} and all(t["type"] == "prometheus" for t in triggers.values())
    assert "tokenmill_queue_depth" in triggers["load"]["metadata"]["query"]
    assert "tokenmill_time_to_first_token_seconds_bucket" in triggers["ttft"]["metadata"]["query"]
    for t in triggers.values():
        float(t["metadata"]["threshold"])
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]


# Labels routers find model servers by: AIBrix's gateway (vllm-project/aibrix pkg/constants/model.go) and
# llm-d (its InferencePool selector and the EPP's engine-type, which picks vLLM's metric names).
ROUTER_LABELS = {"model.aibrix.ai/name", "model.aibrix.ai/port", "model.aibrix.ai/metric-port", "model.aibrix.ai/engine",
                 "llm-d.ai/inferenceServing", "llm-d.ai/model", "llm-d.ai/engine-type"}  # fmt: skip


def test_pods_carry_the_labels_aibrix_and_llm_d_route_by():
    deployment = doc("deployment.yaml")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert ROUTER_LABELS <= labels.keys()
    env = {e["name"]: e.get("value") for e in container()["env"]}
    served = env["TOKENMILL_SERVED_MODEL_NAME"]  # what clients send as `model`: both routers match on it
    assert labels["model.aibrix.ai/name"] == labels["llm-d.ai/model"] == served
    assert deployment["metadata"]["labels"]["model.aibrix.ai/name"] == served
    port = str(container()["ports"][0]["containerPort"])
    assert labels["model.aibrix.ai/port"] == labels["model.aibrix.ai/metric-port"] == port
    assert deployment["metadata"]["labels"]["model.aibrix.ai/port"] == port
    assert labels["llm-d.ai/inferenceServing"] == "true"
    assert labels["model.aibrix.ai/engine"] == labels["llm-d.ai/engine-type"] == "vllm"  # vLLM's metric names
    # the selector stays the app label alone (a Deployment's selector cannot change in place)
    assert deployment["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "tokenmill"}
    settings = ServerSettings(served_model_name=served)
    assert settings.served_model_name == served
