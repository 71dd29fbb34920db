"""Can this process build and launch Triton kernels? Asked once at start-up on CUDA, before the
engine picks the Triton backend, so that a missing toolchain fails there and not at the first request.

A kernel's first launch needs more than `import triton`: Triton compiles the kernel (with the ptxas
its wheel bundles) and a small C launcher, built by the system C compiler ($CC, else gcc or clang)
against Python.h and cached, like the kernel, under Triton's cache (TRITON_CACHE_DIR, default
~/.triton/cache). An image without a compiler, without Python headers or with a read-only home
imports triton fine and fails on the first launch. Two checks, in order:

  toolchain_reason()      builds a C module through Triton's own compile_module_from_src, the
                          function that builds its launchers: the cache, the compiler, Python.h
  kernel_reason(device)   launches store_kv on a tiny cache and checks what it wrote

The first also checks the prerequisites by name (a writable cache, a compiler, Python.h), before the
build and whatever the cache holds, so that the answer names the missing piece. Each returns None
when it passed, else one line saying why not (the engine logs it and serves the PyTorch attention
path).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch

# The smallest extension module: what Triton's launchers are, minus the launch.
PROBE_MODULE = "tokenmill_triton_probe"
PROBE_SOURCE = f"""
#include <Python.h>
static struct PyModuleDef probe = {{PyModuleDef_HEAD_INIT, "{PROBE_MODULE}", NULL, -1, NULL}};
PyMODINIT_FUNC PyInit_{PROBE_MODULE}(void) {{ return PyModule_Create(&probe); }}
"""


def triton_cache_dir() -> Path:
    """The folder Triton caches compiled kernels and launchers in (its knobs: TRITON_CACHE_DIR,
    else $TRITON_HOME/.triton/cache, else ~/.triton/cache)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def toolchain_reason() -> str | None:
    """None when Triton can build its C launchers in this process, else why not."""
    from triton.runtime.build import compile_module_from_src

    reason = _missing_prerequisite()
    if reason is not None:
        return reason
    try:
        module = compile_module_from_src(src=PROBE_SOURCE, name=PROBE_MODULE)
    except Exception as exc:  # the compiler failed, or the module does not load
        return f"Triton could not build a C module with {_compiler()} ({_one_line(exc)})"
    if module.__name__ != PROBE_MODULE:
        return f"Triton built a module named {module.__name__!r}, not {PROBE_MODULE!r}"
    return None


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or "no compiler"


def _missing_prerequisite() -> str | None:
    """What a launcher build needs and this process lacks, in words an operator can act on."""
    cache = triton_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache).close()
    except OSError as exc:
        return f"Triton's cache {cache} is not writable ({_one_line(exc)}); set TRITON_CACHE_DIR to a writable folder"
    cc = os.environ.get("CC")
    if cc is not None and shutil.which(cc) is None:
        return f"no C compiler: CC={cc!r} is not an executable; Triton builds its kernel launchers with one"
    if cc is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        return "no C compiler (gcc or clang) on PATH and CC unset; Triton builds its kernel launchers with one"
    include = Path(_python_include_dir())
    if not (include / "Python.h").is_file():
        return f"no Python.h in {include} (install the Python headers, e.g. python3-dev); Triton's launchers need it"
    return None


def _python_include_dir() -> str:
    # as triton.runtime.build._build finds it (Debian's posix_local scheme has no headers of its own)
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


def kernel_reason(device: torch.device) -> str | None:
    """None when one of our kernels (store_kv) compiles, launches and writes the right rows on `device`."""
    try:
        from engine.attention import triton_kernels as K

        # 3 tokens, 2 KV heads, head_dim 16, into a 4-slot cache; slot -1 stores nothing
        k = torch.arange(3 * 2 * 16, dtype=torch.float32, device=device).view(3, 2, 16)
        v = -k
        k_cache = torch.zeros(2, 4, 16, device=device)
        v_cache = torch.zeros_like(k_cache)
        K.store_kv(k, v, k_cache, v_cache, torch.tensor([2, -1, 0], device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        want = torch.zeros_like(k_cache)
        want[:, 2], want[:, 0] = k[0], k[2]
    except Exception as exc:
        return f"a test kernel failed to compile or run ({_one_line(exc)})"
    if not (torch.equal(k_cache, want) and torch.equal(v_cache, -want)):
        return "a test kernel ran but wrote wrong values"
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
