"""The C++ CPU kernels in engine/csrc: built once per machine with the system C++ compiler, then
loaded into torch.ops.tokenmill.

Built with -march=native (memory-bound loops the compiler vectorises for this CPU's AVX-512/AVX2)
and OpenMP through ATen's intra-op pool: the library links libgomp.so.1, which resolves to the copy
torch already loaded, so there is one thread pool and torch.set_num_threads applies. The library
is cached (cache_dir(): $TOKENMILL_KERNEL_CACHE, else $TOKENMILL_CACHE_DIR/kernels, else
$XDG_CACHE_HOME/tokenmill/kernels, else ~/.cache/tokenmill/kernels), keyed by the sources, the torch
version, the flags and the CPU, and written atomically, so concurrent processes can share it. Without a compiler nothing breaks: `load()` says why and the engine keeps the plain
PyTorch attention. TOKENMILL_CPU_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("tokenmill.engine")

CSRC = Path(__file__).parent / "csrc"
# source -> its own flags. The layer kernels reproduce PyTorch's roundings op by op, so the compiler
# must not contract a * b + c into one fused multiply-add there; the attention products may.
SOURCES = {"cpu_attention.cpp": (), "cpu_layers.cpp": ("-ffp-contract=off",), "cpu_gemv.cpp": (),
           "cpu_gemv_f32.cpp": (), "cpu_lora.cpp": (), "cpu_decode.cpp": (), "cpu_sampling.cpp": ()}
# Sources the library is built without when they do not compile (an older compiler without the
# AVX-512 BF16/VNNI intrinsics): the engine then keeps its oneDNN/PyTorch linears (cpu_linear.py).
OPTIONAL = frozenset({"cpu_gemv.cpp", "cpu_gemv_f32.cpp"})
HEADERS = ("widen.h", "amx.h", "lora.h", "silu.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-w")


def cache_dir() -> Path:
    """Where the built library lives: the first of $TOKENMILL_KERNEL_CACHE, $TOKENMILL_CACHE_DIR/kernels,
    $XDG_CACHE_HOME/tokenmill/kernels, ~/.cache/tokenmill/kernels (unset or empty variables skipped).
    The image points XDG_CACHE_HOME at its cache volume."""
    if kernels := os.environ.get("TOKENMILL_KERNEL_CACHE"):
        return Path(kernels)
    if tokenmill := os.environ.get("TOKENMILL_CACHE_DIR"):
        return Path(tokenmill) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tokenmill" / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def library_path() -> Path:
    h = hashlib.sha256()
    for name, flags in SOURCES.items():
        h.update((CSRC / name).read_bytes() + repr(flags).encode())
    for header in HEADERS:
        h.update((CSRC / header).read_bytes())
    h.update(f"{torch.__version__}|{FLAGS}|{platform.machine()}|{_cpu_signature()}".encode())
    return cache_dir() / f"tokenmill_cpu_{h.hexdigest()[:16]}.so"


def _compile(out: Path) -> None:
    from torch.utils import cpp_extension

    wanted = os.environ.get("CXX")
    cxx = shutil.which(wanted) if wanted else shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({wanted!r} from $CXX)" if wanted else "no C++ compiler (g++ or c++) on PATH")
    lib_dirs = cpp_extension.library_paths()
    common = [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    common += [f"-I{p}" for p in [CSRC, *cpp_extension.include_paths()]]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = {name: os.path.join(tmp, name + ".o") for name in SOURCES}
        # one compiler per source, as many at once as this process may use cores: each spends most of
        # its time in torch's headers, so a first start on 2 cores takes half as long
        with ThreadPoolExecutor(max_workers=min(len(SOURCES), len(os.sched_getaffinity(0)))) as pool:
            built = {name: pool.submit(_run, [cxx, *common, *flags, "-c", str(CSRC / name), "-o", objs[name]], name)
                     for name, flags in SOURCES.items()}  # fmt: skip
        objects = []
        for name, job in built.items():
            exc = job.exception()
            if exc is not None:
                if name not in OPTIONAL:
                    raise exc
                log.warning("building the CPU kernels without %s: %s", name, str(exc)[-500:])
                continue
            objects.append(objs[name])
        lib = os.path.join(tmp, out.name)
        link = [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in lib_dirs] + ["-lc10", "-ltorch_cpu"]
        _run([cxx, "-shared", "-fopenmp", *objects, *link, "-o", lib], "linking")
        os.replace(lib, out)  # atomic: a concurrent loader sees no file or a whole one


def _run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"building the CPU kernels ({what}) failed:\n{res.stderr[-2000:]}")


@functools.lru_cache(maxsize=1)
def load() -> str | None:
    """Build (the first time on this machine) and load the kernels: None on success, else why not.
    Loaded once per process (a library cannot be unloaded from torch.ops)."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return "turned off by TOKENMILL_CPU_KERNELS=0"
    try:
        path = library_path()
        if not path.exists():
            log.info("building the CPU kernels into %s (once per machine, ~15 s)", path)
            try:
                _compile(path)
            except OSError:  # the cache folder is not writable: build for this process only
                path = Path(tempfile.mkdtemp(prefix="tokenmill-kernels-")) / path.name
                _compile(path)
        torch.ops.load_library(str(path))
        return None
    except Exception as exc:  # no compiler, a read-only home, a broken toolchain: keep the torch path
        return f"{type(exc).__name__}: {exc}"
