"""The engine knows nothing of HTTP; the server knows nothing of tensors."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FORBIDDEN = {"fastapi", "starlette", "sse_starlette", "uvicorn", "prometheus_client", "pydantic_settings",
                    "asyncio", "httpx", "server"}
SERVER_FORBIDDEN = {"torch", "safetensors"}


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
