"""mypy over the typed boundary (pyproject.toml [tool.mypy]): engine/api/'s EngineProtocol, the engine
core, the server, and the tests' fake engine; the real Engine and the fake must satisfy the protocol."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_boundary_type_checks():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
