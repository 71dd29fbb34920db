"""The engine knows nothing of HTTP; the server knows nothing of tensors; server/ is packages in layers
(http < prompt < config < ops < serving < api < app.py, cli.py), each importing only those below it;
and no module of engine/ or server/ is part of an import cycle. Every import counts, at any depth of a
module (a function's lazy import and a TYPE_CHECKING import too): a cycle is broken by moving names,
not by hiding an import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FORBIDDEN = {"fastapi", "starlette", "sse_starlette", "uvicorn", "prometheus_client", "pydantic_settings",
                    "asyncio", "httpx", "server"}
SERVER_FORBIDDEN = {"torch", "safetensors", "xgrammar"}  # xgrammar loads torch
# server's packages, lowest first: a module may import its own package and those listed before it.
LAYERS = ("http", "prompt", "config", "ops", "serving", "api")
TOP = len(LAYERS)  # server/app.py, server/cli.py, server/__main__.py, server/__init__.py


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file."""
    return {name.split(".")[0] for name in _imported_modules(path, ROOT)}


def _imported_modules(path: Path, root: Path) -> set[str]:
    """Dotted names of every module the file imports (`from a.b import c` gives a.b and a.b.c: c may be
    a module), resolving relative imports against the file's package."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def module_graph(root: Path, packages: tuple[str, ...] = ("engine", "server")) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (names that are not modules, such as a class
    imported from a module, are dropped; so are a module's own parent packages, which Python imports
    before any of their modules whatever the module says)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts): p for pkg in packages
             for p in (root / pkg).rglob("*.py")}  # fmt: skip
    modules = {name.removesuffix(".__init__"): path for name, path in files.items()}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imported_modules(path, root)
                       if m in modules and m != name and not name.startswith(m + ".")}  # fmt: skip
    return graph


def layer_of(module: str) -> int | None:
    """The rank of a server module's package (None: not a server module)."""
    parts = module.split(".")
    if parts[0] != "server":
        return None
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in sorted(graph.items()):
        rank = layer_of(module)
        for target in sorted(imported):
            target_rank = layer_of(target)
            if module.startswith("engine") and target.startswith("server"):
                bad.append(f"{module} -> {target} (the engine imports no server code)")
            elif rank is not None and target_rank is not None and target_rank > rank:
                bad.append(f"{module} -> {target} ({_name(rank)} may not import {_name(target_rank)})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _name(rank: int) -> str:
    return f"server.{LAYERS[rank]}" if rank < TOP else "server's top (app, cli)"


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


def test_every_server_module_sits_in_a_layer():
    """A new folder under server/ must be placed in LAYERS (or it would escape the check)."""
    folders = {p.name for p in (ROOT / "server").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS)
    top = {p.name for p in (ROOT / "server").glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "app.py", "cli.py"}


def test_server_packages_import_only_those_below_them():
    graph = module_graph(ROOT)
    assert len([m for m in graph if m.startswith("server.")]) > 40
    assert layering_violations(graph) == []


def test_no_import_cycles_in_engine_or_server():
    assert cycles(module_graph(ROOT)) == []


@pytest.fixture
def planted(tmp_path):
    """A copy of engine/ and server/ where a test may add modules."""
    import shutil

    for pkg in ("engine", "server"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    return tmp_path


def test_the_check_catches_a_lower_package_importing_a_higher_one(planted):
    (planted / "server" / "http" / "planted.py").write_text(
        "def f():\n    from server.serving.runtime import Runtime  # a lazy import counts too\n    return Runtime\n")
    bad = layering_violations(module_graph(planted))
    assert bad == ["server.http.planted -> server.serving.runtime (server.http may not import server.serving)"]


def test_the_check_catches_an_import_cycle(planted):
    (planted / "server" / "prompt" / "planted_a.py").write_text("from server.prompt import planted_b\n")
    (planted / "server" / "prompt" / "planted_b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from server.prompt.planted_a import x\n")
    assert cycles(module_graph(planted)) == [["server.prompt.planted_a", "server.prompt.planted_b"]]
    assert layering_violations(module_graph(planted)) == []  # same package: allowed, but not in a cycle


def test_the_check_catches_the_engine_importing_the_server(planted):
    (planted / "engine" / "planted.py").write_text("import server.app\n")
    assert layering_violations(module_graph(planted)) == ["engine.planted -> server.app (the engine imports no server code)"]


def test_importing_the_server_loads_no_torch():
    """Checked in the running process, so an indirect import (server -> engine package -> torch) is
    caught too, not only import lines in server/."""
    code = ("import sys; import server.app, server.cli, server.serving.worker, engine, engine.api; "
            "bad = sorted(m for m in ('torch', 'safetensors', 'transformers', 'xgrammar') if m in sys.modules); "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing the server loaded {done.stdout.strip()} {done.stderr[-2000:]}"


def test_engine_api_is_torch_free():
    code = ("import sys, engine.api, engine.core, engine.scheduler, engine.structured; "
            "sys.exit('torch' in sys.modules or 'xgrammar' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0
