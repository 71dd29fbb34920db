"""bench/ is packages in layers: lib/ (what the benchmarks share) below the benchmark packages, which
import lib/ and their own modules but not each other, below cli.py; no module of bench/ is part of an
import cycle. Every import counts, at any depth of a module (a function's lazy import too)."""

from __future__ import annotations

import shutil

import pytest

from tests.test_layering import ROOT, cycles, module_graph

# bench's packages by rank, lowest first: a module may import its own package and those of a lower rank.
LAYERS = (("lib",), ("inproc", "served", "fleet", "report", "scripts"))
DATA_FOLDERS = {"data", "peers"}  # no Python: files the benchmarks read, the side-by-side shell scripts
TOP_MODULES = {"__init__.py", "__main__.py", "cli.py"}


def package_of(module: str) -> str | None:
    """bench.served.load -> served; None for bench's top modules (cli, __main__, bench itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in _ranks()) else None


def _ranks() -> dict[str, int]:
    return {pkg: rank for rank, group in enumerate(LAYERS) for pkg in group}


def bench_violations(graph: dict[str, set[str]]) -> list[str]:
    """`module -> target (why)` for every import that runs sideways or back up."""
    ranks, bad = _ranks(), []
    for module, imported in sorted(graph.items()):
        pkg = package_of(module)
        if pkg is None:
            continue  # cli.py and friends sit on top
        for target in sorted(t for t in imported if t.startswith("bench")):
            other = package_of(target)
            if other is None:
                bad.append(f"{module} -> {target} (a package may not import bench's top modules)")
            elif other != pkg and ranks[other] >= ranks[pkg]:
                bad.append(f"{module} -> {target} (bench.{pkg} may not import bench.{other})")
    return bad


def test_every_bench_folder_sits_in_a_layer():
    """A new folder under bench/ must be placed in LAYERS (or it would escape the check)."""
    folders = {p.name for p in (ROOT / "bench").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(_ranks()) | DATA_FOLDERS
    assert {p.name for p in (ROOT / "bench").glob("*.py")} == TOP_MODULES
    assert not list((ROOT / "bench" / "peers").glob("*.py")) and not list((ROOT / "bench" / "data").glob("*.py"))


def test_bench_packages_import_only_those_below_them():
    graph = module_graph(ROOT, ("bench",))
    assert len(graph) > 40
    assert bench_violations(graph) == []


def test_no_import_cycles_in_bench():
    assert cycles(module_graph(ROOT, ("bench",))) == []


@pytest.fixture
def planted(tmp_path):
    """A copy of bench/ where a test may add modules."""
    shutil.copytree(ROOT / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_check_catches_a_benchmark_importing_another(planted):
    (planted / "bench" / "served" / "planted.py").write_text(
        "def f():\n    from bench.inproc.spec import run  # a lazy import counts too\n    return run\n")
    assert bench_violations(module_graph(planted, ("bench",))) == [
        "bench.served.planted -> bench.inproc.spec (bench.served may not import bench.inproc)"]


def test_the_check_catches_the_library_importing_a_benchmark_or_the_cli(planted):
    (planted / "bench" / "lib" / "planted.py").write_text("import bench.fleet.router\nfrom bench import cli\n")
    assert bench_violations(module_graph(planted, ("bench",))) == [
        "bench.lib.planted -> bench.cli (a package may not import bench's top modules)",
        "bench.lib.planted -> bench.fleet.router (bench.lib may not import bench.fleet)"]


def test_the_check_catches_an_import_cycle(planted):
    (planted / "bench" / "lib" / "planted_a.py").write_text("from bench.lib import planted_b\n")
    (planted / "bench" / "lib" / "planted_b.py").write_text("from bench.lib.planted_a import x\n")
    assert cycles(module_graph(planted, ("bench",))) == [["bench.lib.planted_a", "bench.lib.planted_b"]]
