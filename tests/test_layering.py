"""The engine knows nothing of HTTP; the server knows nothing of tensors; server/ and engine/ are each
packages in layers (ENGINE_LAYERS, LAYERS below), each importing only its own and those below it; and
no module of engine/ or server/ is part of an import cycle. Every import counts, at any depth of a
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
# engine's packages (and its three top-level modules), lowest first; docs/ENGINE.md reads them in order.
ENGINE_LAYERS = ("config", "kernels", "structured", "api", "text", "attention", "lora", "request", "state", "models",
                 "kv", "spec", "sched", "sample", "weights", "runner", "core", "testing", "engine", "conformance")
ENGINE_TOP = len(ENGINE_LAYERS)  # engine/__init__.py: the public API, resolved lazily


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
    """The rank of a server or engine module's package among its own tree's layers (None: neither)."""
    parts = module.split(".")
    if parts[0] == "server":
        return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP
    if parts[0] == "engine":
        if len(parts) == 1:
            return ENGINE_TOP
        return ENGINE_LAYERS.index(parts[1]) if parts[1] in ENGINE_LAYERS else -1  # -1: unplaced (a test fails)
    return None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in sorted(graph.items()):
        rank = layer_of(module)
        for target in sorted(imported):
            target_rank = layer_of(target)
            if module.startswith("engine") and target.startswith("server"):
                bad.append(f"{module} -> {target} (the engine imports no server code)")
            elif (rank is not None and target_rank is not None and module.split(".")[0] == target.split(".")[0]
                  and target_rank > rank):
                bad.append(f"{module} -> {target} ({_name(module, rank)} may not import {_name(target, target_rank)})")
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


def _name(module: str, rank: int) -> str:
    if module.startswith("engine"):
        return f"engine.{ENGINE_LAYERS[rank]}" if rank < ENGINE_TOP else "engine's top (__init__)"
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


def test_every_engine_module_sits_in_a_layer():
    """A new package or top-level module of engine/ must be placed in ENGINE_LAYERS; the top level stays
    small (packages by concern, not flat modules)."""
    names = {p.stem for p in (ROOT / "engine").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}  # fmt: skip
    assert names == set(ENGINE_LAYERS)
    assert len([p for p in (ROOT / "engine").glob("*.py")]) <= 8


def test_docs_engine_map_names_every_package_and_module():
    """docs/ENGINE.md's map names each engine package (as `name/`) and, within the package's entry, each
    of its modules, so the map cannot fall behind the code."""
    doc = (ROOT / "docs" / "ENGINE.md").read_text()
    section = doc[doc.index("### The map, lowest layer first"):]
    entries = {}
    for block in section.split("\n- **`")[1:]:
        name = block.split("`", 1)[0]
        entries[name.rstrip("/").removesuffix(".py")] = block.split("\n- **`")[0].split("\n\n")[0]
    assert set(entries) == set(ENGINE_LAYERS), "docs/ENGINE.md's map and ENGINE_LAYERS differ"
    missing = []
    for pkg in ENGINE_LAYERS:
        folder = ROOT / "engine" / pkg
        if not folder.is_dir():
            continue
        for module in sorted(folder.iterdir()):
            named = module.name if module.suffix == ".py" else f"{module.name}/"
            if module.name in ("__init__.py", "__pycache__") or not (module.suffix == ".py" or module.is_dir()):
                continue
            if f"`{named}`" not in entries[pkg] and f"`{named.rstrip('/')}`" not in entries[pkg]:
                missing.append(f"engine/{pkg}/{named}")
    assert missing == [], f"docs/ENGINE.md's map does not name {missing}"


def test_engine_packages_import_only_those_below_them():
    graph = module_graph(ROOT)
    assert len([m for m in graph if m.startswith("engine.")]) > 80
    assert layering_violations(graph) == []


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


def test_the_check_catches_an_engine_package_importing_a_higher_one(planted):
    (planted / "engine" / "kv" / "planted.py").write_text(
        "def f():\n    from engine.sample.sampler import Sampler  # a lazy import counts too\n    return Sampler\n")
    bad = layering_violations(module_graph(planted))
    assert bad == ["engine.kv.planted -> engine.sample.sampler (engine.kv may not import engine.sample)"]


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
    """The packages the server and the fake engine import stay torch-free (their __init__ too)."""
    code = ("import sys, engine.api, engine.config, engine.core.step_loop, engine.sched.scheduler, engine.structured, "
            "engine.kv, engine.kv.events, engine.kv.events_zmq, engine.kv.block_manager, engine.spec.proposers, "
            "engine.text.tokenization, engine.text.detokenizer; "
            "sys.exit('torch' in sys.modules or 'xgrammar' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


def import_map(root: Path, package: str) -> str:
    """One line: modules and import arrows between files; packages (and top-level modules) of the tree,
    the arrows between them, and its floors (the longest chain of those arrows, counted in nodes)."""
    graph = {m: ts for m, ts in module_graph(root, (package,)).items()}
    def top(m: str) -> str:
        return m.split(".")[1] if "." in m else "__init__"
    tops: dict[str, set[str]] = {}
    for m, ts in graph.items():
        tops.setdefault(top(m), set()).update(top(x) for x in ts if top(x) != top(m))
    depth: dict[str, int] = {}
    def floor(n: str, seen: tuple[str, ...] = ()) -> int:
        if n not in depth:
            depth[n] = 1 + max((floor(x, (*seen, n)) for x in tops.get(n, ()) if x not in seen), default=0)
        return depth[n]
    return (f"{package}: {len(graph)} modules, {sum(map(len, graph.values()))} arrows between files; top level "
            f"{len(tops)} packages/modules, {sum(map(len, tops.values()))} arrows, {max(map(floor, tops))} floors")


if __name__ == "__main__":  # python -m tests.test_layering [ROOT]: the import map's counts
    tree = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    for pkg in ("engine", "server", "bench"):
        if (tree / pkg).is_dir():
            print(import_map(tree, pkg))
