"""Building the CPU kernels: cached per machine, rebuilt into a fresh folder, refused cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine import cpu_kernels

ROOT = str(Path(__file__).resolve().parents[2])


def _load_in_subprocess(env_extra: dict, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, **env_extra}
    code = "from engine import cpu_kernels; import sys; r = cpu_kernels.load(); print(r); sys.exit(0 if r is None else 3)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)


def test_library_path_depends_on_sources_and_lives_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    path = cpu_kernels.library_path()
    assert path.parent == tmp_path and path.name.startswith("tokenmill_cpu_") and path.suffix == ".so"
    monkeypatch.setattr(cpu_kernels, "SOURCES", {**cpu_kernels.SOURCES, "cpu_layers.cpp": ("-O2",)})
    assert cpu_kernels.library_path() != path  # other flags, another library


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


def test_fresh_cache_builds_then_reuses(tmp_path):
    # XDG_CACHE_HOME as the image sets it (its cache volume); the variables before it unset
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "TOKENMILL_KERNEL_CACHE": "", "TOKENMILL_CACHE_DIR": ""}
    first = _load_in_subprocess(env, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    built = list((tmp_path / "xdg" / "tokenmill" / "kernels").glob("tokenmill_cpu_*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    again = _load_in_subprocess(env, tmp_path)
    assert again.returncode == 0 and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_turned_off_and_missing_compiler_say_why(tmp_path):
    off = _load_in_subprocess({"TOKENMILL_CPU_KERNELS": "0"}, tmp_path)
    assert off.returncode == 3 and "TOKENMILL_CPU_KERNELS=0" in off.stdout
    nocc = _load_in_subprocess({"TOKENMILL_KERNEL_CACHE": str(tmp_path / "empty"), "CXX": "/nonexistent/c++"}, tmp_path)
    assert nocc.returncode == 3 and "no C++ compiler ('/nonexistent/c++' from $CXX)" in nocc.stdout


def test_an_optional_source_that_fails_is_left_out(monkeypatch, tmp_path, caplog):
    """A compiler without the AVX-512 BF16/VNNI intrinsics must not cost the other kernels: the
    library is built without cpu_gemv.cpp, with a warning, and the engine keeps its oneDNN linears."""
    import logging
    import shutil

    import pytest

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    (csrc / "cpu_gemv.cpp").write_text("#error this compiler has no AVX-512 BF16\n")
    monkeypatch.setattr(cpu_kernels, "CSRC", csrc)
    monkeypatch.setattr(cpu_kernels, "SOURCES", {"cpu_layers.cpp": ("-ffp-contract=off",), "cpu_gemv.cpp": ()})
    out = tmp_path / "k" / "lib.so"
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
        cpu_kernels._compile(out)
    assert out.exists()
    assert any("without cpu_gemv.cpp" in r.getMessage() and "AVX-512 BF16" in r.getMessage() for r in caplog.records)
    (csrc / "cpu_layers.cpp").write_text("#error broken\n")  # a required source still fails the build
    with pytest.raises(RuntimeError, match="cpu_layers.cpp"):
        cpu_kernels._compile(tmp_path / "k2" / "lib.so")
