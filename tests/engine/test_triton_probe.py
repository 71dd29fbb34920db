"""The start-up check on CUDA that Triton can build and launch kernels (engine/attention/triton_probe.py),
run on the CPU: the GPU's capability query is faked, everything before the launch is real. An image
without a compiler, without Python.h or with a read-only Triton cache must fall back to the PyTorch
attention path at start-up, saying why in one log line, instead of failing the first request."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attention import TorchAttentionBackend, select_backend, triton_probe, triton_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _triton():
    # imported here, not at collection: test_triton_kernels.py must set TRITON_INTERPRET before the
    # process first imports triton (triton.language's own helpers are decorated at that import)
    pytest.importorskip("triton")


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 as far as the capability check can tell."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def unwritable(tmp_path: Path) -> Path:
    # below a regular file: no one can create it, root included (the tests may run as root)
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "cache"


def test_toolchain_builds_a_c_module_into_the_triton_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert triton_probe.triton_cache_dir() == tmp_path / "triton"
    assert triton_probe.toolchain_reason() is None
    built = list((tmp_path / "triton").rglob(f"{triton_probe.PROBE_MODULE}*.so"))
    assert len(built) == 1  # through Triton's own build and cache, as its launchers are


def test_an_unwritable_cache_falls_back_to_torch_in_one_log_line(monkeypatch, tmp_path, caplog, hopper):
    # the image as it was: HOME (so ~/.triton) not writable, TRITON_CACHE_DIR unset
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(unwritable(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
        backend = select_backend("cuda", "auto", torch.bfloat16, num_sms=132)
    assert type(backend) is TorchAttentionBackend
    (record,) = [r for r in caplog.records if r.name == "tokenmill.engine"]
    message = record.getMessage()
    assert "\n" not in message and "PyTorch reference backend" in message
    assert f"Triton's cache {unwritable(tmp_path)}/.triton/cache is not writable" in message
    with pytest.raises(ValueError, match="is not writable"):  # asked for by name: refuse to start
        select_backend("cuda", "triton", torch.bfloat16, num_sms=132)


def test_no_compiler_on_path_says_so(monkeypatch, tmp_path, hopper):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    reason = triton_unavailable_reason(CUDA)
    assert reason is not None and reason.startswith("no C compiler (gcc or clang) on PATH")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert "CC='/nonexistent/cc' is not an executable" in triton_unavailable_reason(CUDA)


def test_no_python_headers_says_so(monkeypatch, tmp_path, hopper):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(triton_probe, "_python_include_dir", lambda: str(tmp_path))
    reason = triton_unavailable_reason(CUDA)
    assert reason is not None and f"no Python.h in {tmp_path}" in reason and "python3-dev" in reason


def test_a_compiler_that_fails_is_reported_by_tritons_own_build(tmp_path):
    """Every prerequisite present, the build itself fails: the error comes from Triton's
    compile_module_from_src. A fresh process (Triton remembers the compiler it found)."""
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'broken-cc: cannot compile' >&2\nexit 1\n")
    cc.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CC": str(cc), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    code = "from engine.attention import triton_probe; print(triton_probe.toolchain_reason())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"Triton could not build a C module with {cc} (CalledProcessError"), run.stdout
    assert not list((tmp_path / "triton").rglob("*.so"))


def test_on_cuda_the_probe_launches_a_kernel_after_the_toolchain(monkeypatch, tmp_path, hopper):
    """Toolchain fine: the next step is a launch on the device. On a machine without CUDA that
    launch is what fails, and says so; with a GPU it passes."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = triton_unavailable_reason(CUDA)
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert reason is not None and reason.startswith("a test kernel failed to compile or run")
    assert list((tmp_path / "triton").rglob(f"{triton_probe.PROBE_MODULE}*.so"))  # the toolchain ran first


def test_the_cpu_under_the_interpreter_needs_no_toolchain(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_HOME", str(unwritable(tmp_path)))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert triton_unavailable_reason(torch.device("cpu")) is None
