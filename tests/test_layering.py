"""The engine knows nothing of HTTP; the server knows nothing of tensors."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FORBIDDEN = {"fastapi", "starlette", "sse_starlette", "uvicorn", "prometheus_client", "pydantic_settings",
                    "asyncio", "httpx", "server"}
SERVER_FORBIDDEN = {"torch", "safetensors", "xgrammar"}  # xgrammar loads torch


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _violations(package: str, forbidden: set[str]) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        hit = _imports(path) & forbidden
        if hit:
            bad.append(f"{path.relative_to(ROOT)}: {sorted(hit)}")
    return bad


def test_engine_imports_no_http_or_metrics_code():
    assert list((ROOT / "engine").rglob("*.py")), "engine package not found"
    assert _violations("engine", ENGINE_FORBIDDEN) == []


def test_server_imports_no_torch():
    assert list((ROOT / "server").rglob("*.py")), "server package not found"
    assert _violations("server", SERVER_FORBIDDEN) == []


def test_importing_the_server_loads_no_torch():
    """Checked in the running process, so an indirect import (server -> engine package -> torch) is
    caught too, not only import lines in server/."""
    import subprocess
    import sys

    code = ("import sys; import server.app, server.cli, server.worker, engine, engine.api; "
            "bad = sorted(m for m in ('torch', 'safetensors', 'transformers', 'xgrammar') if m in sys.modules); "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing the server loaded {done.stdout.strip()} {done.stderr[-2000:]}"


def test_engine_api_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, engine.api, engine.core, engine.scheduler, engine.structured; "
            "sys.exit('torch' in sys.modules or 'xgrammar' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0
