"""Dockerfile: hadolint clean; a CUDA runtime base, multi-stage, a non-root user, a HEALTHCHECK on
/health, models never copied in, 0.0.0.0 inside the container only."""

from __future__ import annotations

import re
import subprocess

import pytest

from server.config.settings import ServerSettings

from .conftest import REPO, find_tool, run

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


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


def test_cuda_runtime_multistage_non_root_with_healthcheck():
    ins = instructions()
    args = dict(i[1].split("=", 1) for i in ins if i[0] == "ARG" and "=" in i[1])
    stages = [a for i, a in ins if i == "FROM"]
    assert len(stages) >= 2
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", args["CUDA_IMAGE"])
    assert stages[-1].startswith("${CUDA_IMAGE} AS runtime")
    final = ins[max(n for n, (i, _) in enumerate(ins) if i == "FROM"):]
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    (health,) = [a for i, a in final if i == "HEALTHCHECK"]
    assert "/health" in health and "--start-period" in health
    env = " ".join(a for i, a in final if i == "ENV")
    assert "TOKENMILL_HOST=0.0.0.0" in env
    assert ServerSettings.model_fields["host"].default == "127.0.0.1"  # outside a container: loopback
    assert ("EXPOSE", "8000") in final
    assert [a for i, a in final if i == "ENTRYPOINT"] == ['["tokenmill", "serve"]']


def test_models_are_never_baked_in():
    copies = [a for i, a in instructions() if i in ("COPY", "ADD")]
    assert not any("models" in a for a in copies)
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    assert ignore[[n for n, line in enumerate(ignore) if line and not line.startswith("#")][0]] == "*"
    assert not any(line.startswith("!") and "model" in line for line in ignore)
    assert "**/*.safetensors" in ignore
