"""Every custom resource in deploy/k8s/gateway/ (the InferencePool, the HTTPRoute) validated against the
openAPIV3Schema of its CRD's version, the CRDs vendored verbatim in tests/deploy/crds/ (each file's
header names the source repository, path and commit). Unknown fields are refused, as kubectl's default
strict field validation refuses them; the CRDs' CEL rules (`x-kubernetes-validations`) are not evaluated.
The validator is checked too: the examples with any one required field removed, an unknown field added
or an enum value misspelt must fail."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from .conftest import DEPLOY

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the dev extra)")

GATEWAY = DEPLOY / "k8s" / "gateway"
CRDS = Path(__file__).parent / "crds"
# API groups Kubernetes serves itself (validated by kubernetes-validate in test_router_manifests.py);
# any other group is a custom resource and needs its CRD here
BUILT_IN = {"", "apps", "rbac.authorization.k8s.io", "policy", "autoscaling", "batch", "networking.k8s.io"}


def strict(schema):
    """A copy of a CRD schema as a JSON Schema that refuses unknown fields: every object with declared
    properties gets additionalProperties false, unless it preserves unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "default", "example", "required") else strict(v)) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if schema.get("nullable"):  # OpenAPI 3.0's null, which JSON Schema spells as a type
        out["type"] = [schema["type"], "null"]
    return out


def crd_schemas() -> dict[tuple[str, str, str], dict]:
    """(group, version, kind) -> strict JSON Schema, for every served version of every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        spec = crd["spec"]
        for version in spec["versions"]:
            if version["served"]:
                key = (spec["group"], version["name"], spec["names"]["kind"])
                out[key] = strict(version["schema"]["openAPIV3Schema"])
    return out


def group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def custom_resources() -> list[tuple[str, dict]]:
    """(file: kind/name, object) of every custom resource in deploy/k8s/gateway/."""
    out = []
    for path in sorted(GATEWAY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and group_version(doc["apiVersion"])[0] not in BUILT_IN:
                out.append((f"{path.relative_to(GATEWAY)}: {doc['kind']}/{doc['metadata']['name']}", doc))
    return out


SCHEMAS = crd_schemas()
RESOURCES = custom_resources()


def errors(obj: dict) -> list[str]:
    group, version = group_version(obj["apiVersion"])
    schema = SCHEMAS[(group, version, obj["kind"])]
    # OpenAPI 3.0 schemas are draft 4's dialect (boolean exclusiveMinimum/Maximum)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]


def required_paths(obj, schema, path=()):
    """Every path to a required field present in obj, by walking it beside its schema."""
    if isinstance(obj, dict) and isinstance(schema, dict):
        for key in schema.get("required", []):
            if key in obj:
                yield (*path, key)
        for key, value in obj.items():
            if key in schema.get("properties", {}):
                yield from required_paths(value, schema["properties"][key], (*path, key))
    elif isinstance(obj, list) and isinstance(schema, dict) and "items" in schema:
        for i, item in enumerate(obj):
            yield from required_paths(item, schema["items"], (*path, i))


def without(obj: dict, path: tuple) -> dict:
    out = copy.deepcopy(obj)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return out


def test_the_gateway_example_has_the_custom_resources_the_docs_name():
    kinds = {obj["kind"] for _, obj in RESOURCES}
    assert {"InferencePool", "HTTPRoute"} <= kinds


@pytest.mark.parametrize("name,obj", RESOURCES, ids=[n for n, _ in RESOURCES])
def test_custom_resource_validates_against_its_crd(name, obj):
    group, version = group_version(obj["apiVersion"])
    assert (group, version, obj["kind"]) in SCHEMAS, f"{name}: no CRD in {CRDS} serves {obj['apiVersion']} {obj['kind']}"
    assert errors(obj) == [], name


@pytest.mark.parametrize("name,obj", RESOURCES, ids=[n for n, _ in RESOURCES])
def test_removing_any_required_field_fails_validation(name, obj):
    group, version = group_version(obj["apiVersion"])
    paths = list(required_paths(obj, SCHEMAS[(group, version, obj["kind"])]))
    assert paths, f"{name}: no required field found: the walk does not follow the schema"
    for path in paths:
        assert errors(without(obj, path)), f"{name}: still valid without {'.'.join(map(str, path))}"


def test_unknown_fields_and_bad_enums_fail_validation():
    ((_, pool),) = [(n, o) for n, o in RESOURCES if o["kind"] == "InferencePool"]
    typo = copy.deepcopy(pool)
    typo["spec"]["endpointPickerRef"]["failuremode"] = typo["spec"]["endpointPickerRef"].pop("failureMode")
    assert any("failuremode" in e for e in errors(typo))
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailClosed"
    assert errors(bad)
    two_ports = copy.deepcopy(pool)  # v1.0.0's pool takes exactly one target port
    two_ports["spec"]["targetPorts"].append({"number": 8001})
    assert errors(two_ports)
