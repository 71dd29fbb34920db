"""Inside the GPU image's runtime stage, as its user: what the first Triton launch on a GPU will need.

    docker run --rm -i --entrypoint python3 IMAGE - < deploy/docker/gpu_runtime_check.py

make docker-smoke runs it in the GPU variant built on the local Debian base (no CUDA base image;
torch's CPU build and triton 3.7.1 from the wheelhouse): the same runtime stage, user, environment and packages
list as the real image. Checked: the user is not root; a C compiler, Python.h and a writable Triton cache
on /cache; the engine's start-up toolchain check (a C module built through Triton's own launcher
build); and every kernel variant of a bf16 Qwen2.5-0.5B shape compiled for sm_90 by Triton's compiler
and its bundled ptxas, into that cache. Not checked here: the CUDA base image, the CUDA torch build
and a launch (docs/DEPLOY.md, "What CI checks").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def check(ok: bool, what: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    from engine.kernels import cpu_kernels
    from engine.attention import triton_probe

    check(os.getuid() != 0, f"runs as uid {os.getuid()}, not root")
    config = os.environ.get("TOKENMILL_CONFIG", "")
    check(config.endswith("/gpu.yaml") and Path(config).is_file(), f"TOKENMILL_CONFIG={config}")
    cc = shutil.which("gcc") or shutil.which("cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0] if cc else ""
    check(bool(version), f"a C compiler on PATH: {cc} ({version})")
    include = Path(triton_probe._python_include_dir())
    check((include / "Python.h").is_file(), f"Python.h in {include}")
    cache = triton_probe.triton_cache_dir()
    probe = cache / ".write-probe"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
        writable = True
    except OSError as exc:
        writable, cache = False, f"{cache} ({exc})"
    check(writable and str(cache).startswith("/cache/"), f"Triton's cache is writable, on the cache volume: {cache}")
    check(str(cpu_kernels.cache_dir()).startswith("/cache/"), f"the CPU kernels' cache: {cpu_kernels.cache_dir()}")
    reason = triton_probe.toolchain_reason()
    check(reason is None, f"the engine's start-up toolchain check: {reason or 'a C module built through Triton'}")
    t0 = time.monotonic()
    import torch

    from engine.attention.triton_aot import compile_all, variants

    compiled = compile_all(90, torch.bfloat16, heads=14, kv_heads=2, head_dim=64)
    names = ", ".join(c.kernel for c in compiled)
    expected = len(list(variants(torch.bfloat16, 14, 2, 64, 16)))  # every variant the engine can launch
    check(len(compiled) == expected >= 5,
          f"{len(compiled)} of {expected} kernels compiled for sm_90 in {time.monotonic() - t0:.0f} s: {names}")
    cubins = list(Path(cache).rglob("*.cubin"))
    check(len(cubins) >= expected, f"{len(cubins)} cubins in Triton's cache")


if __name__ == "__main__":
    main()
