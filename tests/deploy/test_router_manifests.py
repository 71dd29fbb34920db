"""vllm-router's deployment files: its image (deploy/router/Dockerfile: hadolint clean, the version
pyproject.toml's `router` extra pins, the main Dockerfile's CPU base), its Kubernetes Deployment with
label-selector service discovery and the RBAC that needs (kubernetes-validate --strict, then the wiring),
the compose and Kubernetes arguments parsed by the router's own parser, and the Gateway API Inference
Extension example's core kinds and wiring (its custom resources against their CRDs' schemas:
test_gateway_crds.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from .conftest import DEPLOY, REPO, find_tool, run

K8S = DEPLOY / "k8s"
ROUTER_DOCKERFILE = DEPLOY / "router" / "Dockerfile"


def docs(path) -> dict[str, dict]:
    """kind/name -> object, of a multi-document YAML file."""
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(path.read_text()) if d}


def router_pin() -> str:
    """The pin in pyproject.toml's `router = [...]` extra."""
    (extra,) = re.findall(r"^router = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    (pin,) = re.findall(r'"(vllm-router[^"]*)"', extra)
    return pin


def parse_router(args: list[str]):
    """The router's own command-line parser (vllm_router.launch_router): what the binary would run."""
    launch = pytest.importorskip("vllm_router.launch_router", reason="vllm-router is not installed (the router extra)")
    return launch.parse_router_args(args)


def test_router_image_pins_the_extra_on_the_main_base():
    text = ROUTER_DOCKERFILE.read_text()
    (pip,) = re.findall(r"^ARG ROUTER_PIP=(\S+)$", text, re.M)
    assert pip == router_pin() == "vllm-router==0.1.17"
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    (cpu,) = re.findall(r"^ARG CPU_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert base == cpu
    assert "${OFFLINE:+--no-index --find-links /wheelhouse}" in text  # builds with no network, as the main one
    assert re.search(r"^USER 10001:10001$", text, re.M) and "/readiness" in text
    # the wheelhouse (all of tokenmill's wheels) only in the build stage: the image holds the venv alone
    *_, final = re.split(r"^FROM ", text, flags=re.M)
    assert "wheelhouse" not in final and "COPY --from=build /opt/venv /opt/venv" in final


def test_wheelhouse_fetches_the_router_pin_and_the_smoke_builds_the_image_from_it():
    script = (DEPLOY / "docker" / "wheelhouse.sh").read_text()
    (reqs,) = re.findall(r"<<'PY'\n(.*?)\nPY\n", script, re.S)  # the requirements wheelhouse.sh downloads
    out = subprocess.run([sys.executable, "-c", reqs], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert router_pin() in out.splitlines()
    assert 'ls "$OUT"/vllm_router-*.whl' in script  # and stops when pip did not fetch its wheel
    smoke = (DEPLOY / "docker" / "smoke.sh").read_text()
    (build,) = re.findall(r"^build\(\) \{.*?^\}", smoke, re.S | re.M)
    assert '--build-arg BASE_IMAGE="$BASE" --build-arg OFFLINE=1' in build and "--network none" in build
    assert re.search(r'^build "\$ROUTER_IMAGE_TAG" -f deploy/router/Dockerfile$', smoke, re.M)
    # run in front of the tokenmill container, its readiness and a chat through it
    assert '--worker-urls "$worker"' in smoke and '$HTTP chat "$router_url"' in smoke


def test_router_dockerfile_passes_hadolint():
    run([find_tool("hadolint"), str(ROUTER_DOCKERFILE)])


def test_router_manifests_pass_kubernetes_validate_strict():
    out = run([find_tool("kubernetes-validate"), "--strict", str(K8S / "router.yaml")]).stdout
    for kind in ("deployment/tokenmill-router", "service/tokenmill-router", "serviceaccount/tokenmill-router",
                 "role/tokenmill-router", "rolebinding/tokenmill-router"):
        assert f"passed for resource {kind}" in out, out


def test_router_discovers_the_tokenmill_pods_with_the_rights_it_needs():
    objs = docs(K8S / "router.yaml")
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    pod = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http")
    spec = objs["Deployment/tokenmill-router"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = parse_router(c["args"])
    assert args.service_discovery and args.selector.items() <= pod["metadata"]["labels"].items() and args.selector
    assert args.service_discovery_namespace == namespace and args.service_discovery_port == port
    assert args.policy == "cache_aware" and args.health_check_endpoint == "/health"
    assert args.health_check_interval_secs <= 5 and args.health_failure_threshold == 1
    assert args.worker_urls == []  # the pods come from discovery only
    # the RBAC: read pods in this namespace, nothing more, bound to the router's account
    (rule,) = objs["Role/tokenmill-router"]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = objs["RoleBinding/tokenmill-router"]
    assert binding["roleRef"]["name"] == "tokenmill-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": namespace}]
    service = objs["Service/tokenmill-router"]
    assert service["spec"]["selector"].items() <= objs["Deployment/tokenmill-router"]["spec"]["template"]["metadata"]["labels"].items()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["securityContext"]["readOnlyRootFilesystem"] and spec["securityContext"]["runAsNonRoot"]


def test_compose_router_arguments_parse():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["router"]
    cmd = [a.replace("${TOKENMILL_ROUTER_POLICY:-cache_aware}", "cache_aware") for a in compose["command"]]
    args = parse_router(cmd)
    assert args.worker_urls == ["http://tokenmill:8000", "http://tokenmill-2:8000"]
    assert args.policy == "cache_aware" and args.health_check_endpoint == "/health"


def test_gateway_example_core_kinds_validate(tmp_path):
    objs = docs(K8S / "gateway" / "inferencepool.yaml")
    core = [d for d in objs.values() if d["apiVersion"] in ("v1", "apps/v1", "rbac.authorization.k8s.io/v1")]
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    out = run([find_tool("kubernetes-validate"), "--strict", str(path)]).stdout
    for kind in ("deployment/tokenmill-epp", "service/tokenmill-epp", "role/tokenmill-epp"):
        assert f"passed for resource {kind}" in out, out


def test_inferencepool_selects_the_tokenmill_pods_and_names_the_picker():
    objs = docs(K8S / "gateway" / "inferencepool.yaml")
    pool = objs["InferencePool/tokenmill"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    # InferencePool v1: selector.matchLabels, exactly one targetPort, endpointPickerRef {name, port.number}
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert set(spec["selector"]) == {"matchLabels"}
    pod = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec["targetPorts"] == [{"number": 8000}]
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"} and ref["failureMode"] in ("FailOpen", "FailClose")
    epp = objs[f"Service/{ref['name']}"]
    assert [p["port"] for p in epp["spec"]["ports"]] == [ref["port"]["number"]]
    route = objs["HTTPRoute/tokenmill"]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tokenmill"}
    (c,) = objs["Deployment/tokenmill-epp"]["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--pool-name") + 1] == "tokenmill"
    rules = objs["Role/tokenmill-epp"]["rules"]
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"]} in rules  # fmt: skip


def test_compose_kv_events_router_arguments_parse():
    compose = yaml.safe_load((REPO / "docker-compose.kv-events.yml").read_text())["services"]["router"]
    cmd = [a if not a.startswith("${TOKENMILL_MODEL") else "/models/m" for a in compose["command"]]
    args = parse_router(cmd)
    assert args.policy == "kv_aware" and args.kv_event_block_size == 16 and args.kv_event_model == "/models/m"
    assert args.kv_event_source == ["http://tokenmill:8000=tcp://tokenmill:5557",
                                    "http://tokenmill-2:8000=tcp://tokenmill-2:5557"]  # fmt: skip
