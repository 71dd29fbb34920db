"""Building the CPU kernels: one library per group, cached per machine, rebuilt into a fresh folder; a
group that does not compile leaves the others in use, is remembered (not compiled again at every
start), and under TOKENMILL_REQUIRE_KERNELS=1 stops the start with the compiler's first error line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.kernels import cpu_kernels

ROOT = str(Path(__file__).resolve().parents[2])
HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None


def _run(code: str, env_extra: dict, tmp_path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (a library cannot be unloaded from torch.ops), strict mode off
    unless env_extra sets it."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TOKENMILL_REQUIRE_KERNELS": "0", **env_extra}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=900)


# In a subprocess: the groups (and sources folder) replaced, then every group's reason printed.
SOME_GROUPS = """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from pathlib import Path
    from engine.kernels import cpu_kernels
    cpu_kernels.CSRC = Path({csrc!r}) if {csrc!r} else cpu_kernels.CSRC
    cpu_kernels.GROUPS = {groups!r}
    reasons = {{g: cpu_kernels.load(g) for g in cpu_kernels.GROUPS}}
    for g, r in reasons.items():
        print(f"{{g}}: {{r}}")
"""


def _some_groups(groups: dict, tmp_path, env: dict, csrc: str = "") -> subprocess.CompletedProcess:
    return _run(SOME_GROUPS.format(groups=groups, csrc=csrc), env, tmp_path)


def test_each_group_has_its_library_named_by_its_sources_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    paths = {g: cpu_kernels.library_path(g) for g in cpu_kernels.GROUPS}
    assert len(set(paths.values())) == len(paths)
    for g, path in paths.items():
        assert path.parent == tmp_path and path.name.startswith(f"tokenmill_{g}_") and path.suffix == ".so"
    monkeypatch.setattr(cpu_kernels, "FLAGS", (*cpu_kernels.FLAGS, "-DTM_SOMETHING"))
    assert cpu_kernels.library_path("layers") != paths["layers"]  # other flags, another library


def test_the_flags_are_the_same_on_every_machine():
    """No -march=native: the library a machine builds runs on any x86-64 CPU (the paths are chosen at
    run time), and what compiles on the CI machine compiles everywhere."""
    assert not any("native" in f for f in cpu_kernels.FLAGS)
    if cpu_kernels.X86:
        assert "-march=x86-64" in cpu_kernels.FLAGS


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for name in ("TOKENMILL_KERNEL_CACHE", "TOKENMILL_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu_kernels.cache_dir() == tmp_path / "home" / ".cache" / "tokenmill" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset (XDG base directory spec)
    assert cpu_kernels.cache_dir() == tmp_path / "home" / ".cache" / "tokenmill" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the image: /cache, its volume
    assert cpu_kernels.cache_dir() == tmp_path / "xdg" / "tokenmill" / "kernels"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "tm"))
    assert cpu_kernels.cache_dir() == tmp_path / "tm" / "kernels"
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path / "k"))
    assert cpu_kernels.cache_dir() == tmp_path / "k"


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_fresh_cache_builds_then_reuses(tmp_path):
    # XDG_CACHE_HOME as the image sets it (its cache volume); the variables before it unset
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "TOKENMILL_KERNEL_CACHE": "", "TOKENMILL_CACHE_DIR": ""}
    groups = {"sampling": cpu_kernels.GROUPS["sampling"]}
    first = _some_groups(groups, tmp_path, env)
    assert first.returncode == 0 and "sampling: None" in first.stdout, first.stdout + first.stderr
    built = list((tmp_path / "xdg" / "tokenmill" / "kernels").glob("tokenmill_sampling_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    again = _some_groups(groups, tmp_path, env)
    assert "sampling: None" in again.stdout and "building" not in again.stderr  # loaded, not rebuilt
    assert built[0].stat().st_mtime_ns == mtime


def test_turned_off_and_missing_compiler_say_why(tmp_path):
    groups = {"sampling": cpu_kernels.GROUPS["sampling"]}
    off = _some_groups(groups, tmp_path, {"TOKENMILL_CPU_KERNELS": "0"})
    assert "sampling: turned off by TOKENMILL_CPU_KERNELS=0" in off.stdout
    nocc = _some_groups(groups, tmp_path, {"TOKENMILL_KERNEL_CACHE": str(tmp_path / "empty"), "CXX": "/nonexistent/c++"})
    assert "sampling: no C++ compiler ('/nonexistent/c++' from $CXX)" in nocc.stdout
    strict = _some_groups(groups, tmp_path, {"TOKENMILL_CPU_KERNELS": "0", "TOKENMILL_REQUIRE_KERNELS": "1"})
    assert strict.returncode != 0 and "KernelsUnavailable" in strict.stderr and "TOKENMILL_CPU_KERNELS=0" in strict.stderr


def test_an_unknown_path_cap_is_refused(tmp_path):
    res = _some_groups({"sampling": cpu_kernels.GROUPS["sampling"]}, tmp_path, {"TOKENMILL_CPU_ISA": "avx1024"})
    assert res.returncode != 0 and "TOKENMILL_CPU_ISA='avx1024'" in res.stderr


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_a_failing_group_leaves_the_others_is_remembered_and_strict_mode_refuses_it(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    (csrc / "broken.cpp").write_text("// a source this compiler refuses\nint broken( { return 0; }\n")
    groups = {"sampling": cpu_kernels.GROUPS["sampling"], "broken": ("broken.cpp",)}
    env = {"TOKENMILL_KERNEL_CACHE": str(tmp_path / "cache")}
    first = _some_groups(groups, tmp_path, env, str(csrc))
    assert first.returncode == 0, first.stderr
    assert "sampling: None" in first.stdout  # the other group built and loaded
    broken = next(line for line in first.stdout.splitlines() if line.startswith("broken:"))
    assert "broken.cpp:2:" in broken and "error" in broken  # the compiler's first error line
    assert len(list((tmp_path / "cache").glob("tokenmill_broken_*.failed"))) == 1
    again = _some_groups(groups, tmp_path, env, str(csrc))
    assert "building" not in again.stderr  # neither compiled again: the failure is remembered
    assert "sampling: None" in again.stdout and "remembered from an earlier build" in again.stdout
    strict = _some_groups(groups, tmp_path, {**env, "TOKENMILL_REQUIRE_KERNELS": "1"}, str(csrc))
    assert strict.returncode != 0 and "KernelsUnavailable" in strict.stderr
    assert "CPU kernel group 'broken'" in strict.stderr and "broken.cpp:2:" in strict.stderr
    (csrc / "broken.cpp").write_text("int broken() { return 0; }\n")  # fixed: another key, built again
    fixed = _some_groups(groups, tmp_path, env, str(csrc))
    assert "broken: None" in fixed.stdout and "building the CPU kernels (broken)" in fixed.stderr


def test_every_group_has_a_path_here():
    """The engine-ready line's kernels: every group loaded with a path (the CI machines all have AVX2;
    strict mode would have raised before this)."""
    paths = cpu_kernels.paths()
    assert set(paths) == set(cpu_kernels.GROUPS)
    assert not [g for g, p in paths.items() if p.startswith("off") or "none" in p], paths
    assert cpu_kernels.describe().startswith("attention=")


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_the_cap_lowers_every_groups_path(tmp_path):
    code = "from engine.kernels import cpu_kernels; print(cpu_kernels.describe())"
    base = _run(code, {"TOKENMILL_CPU_ISA": "base"}, tmp_path)
    assert base.returncode == 0, base.stderr
    line = base.stdout.strip()
    for group in ("attention", "layers", "lora", "sampling"):
        assert f"{group}=portable" in line
    assert "linear=none" in line and "decode=on" in line
    strict = _run(code, {"TOKENMILL_CPU_ISA": "base", "TOKENMILL_REQUIRE_KERNELS": "1"}, tmp_path)
    assert strict.returncode != 0 and "the linear kernels have no path on this CPU" in strict.stderr
