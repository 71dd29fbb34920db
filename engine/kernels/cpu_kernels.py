"""The C++ CPU kernels in engine/kernels/csrc, in groups that build and load on their own: a group that does not
compile (or load) leaves the others in use, and says why.

| group | what | sources |
| --- | --- | --- |
| attention | paged decode attention, the KV store | cpu_attention.cpp, kernels/attention_* |
| layers | RMSNorm (+ residual), rotary | cpu_layers.cpp, kernels/layers_* |
| linear | small-batch bf16 / INT8 / float32 products, silu(gate) * up, read_sum | cpu_gemv*.cpp, kernels/gemv_* |
| lora | the LoRA delta of a step's rows | cpu_lora.cpp, kernels/lora_* |
| sampling | greedy and unfiltered sampling of whole rows | cpu_sampling.cpp, kernels/sampling_* |
| ggml | GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights multiplied from their blocks | cpu_ggml.cpp, kernels/ggml_* |
| moe | an MoE layer's routed experts in one call: tokens grouped by expert, (expert, chunk) work items | cpu_moe.cpp, kernels/gemv_* (the linear group's arithmetic, built in again) |
| decode | the decoder stack of a decode step in one call (runs the others' kernels) | cpu_decode.cpp |

Each group is built once per machine with the system C++ compiler into one library, with the same
portable flags on every machine and for every file (`FLAGS`: no -march=native): the code for an
instruction set lives in engine/kernels/csrc/kernels/, in functions or `#pragma GCC target` regions that carry
its target, and each group picks its path at run time from the CPU's features (engine/kernels/csrc/isa.h):
AMX, AVX-512, AVX2, or portable. So a library built on one CPU runs on any x86-64 CPU, and a build
on a CPU without AMX compiles the AMX code all the same (tests/engine/test_cpu_kernel_targets.py
compiles every kernel source for several -march targets).

OpenMP comes through ATen's intra-op pool: each library links libgomp.so.1, which resolves to the copy
torch already loaded, so there is one thread pool and torch.set_num_threads applies. The libraries are
cached (cache_dir(): $TOKENMILL_KERNEL_CACHE, else $TOKENMILL_CACHE_DIR/kernels, else
$XDG_CACHE_HOME/tokenmill/kernels, else ~/.cache/tokenmill/kernels), keyed by the group's sources, every
header, the flags, the compiler and the torch version, written atomically (concurrent processes can
share the cache). A group whose sources do not compile is remembered (a `.failed` file beside where its
library would be, with the compiler's output), so a server does not spend a minute of every start
compiling it again; delete that file (or change a source) to retry.

No compiler, or a group that fails: the engine keeps its PyTorch path for that group and the
"engine ready" line says so (`describe()`). TOKENMILL_REQUIRE_KERNELS=1 makes that a start-up error
(`KernelsUnavailable`) quoting the compiler's first error line: CI runs with it, so a kernel that stops
building turns CI red instead of making the product slow. TOKENMILL_CPU_KERNELS=0 turns every group off;
TOKENMILL_CPU_ISA=amx|avx512|avx2|base caps the path (an A/B of the paths on one machine).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("tokenmill.engine")

CSRC = Path(__file__).parent / "csrc"

# group -> its sources (relative to CSRC): a binding file that checks tensors and registers the ops,
# then the files with its arithmetic per path.
GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("cpu_attention.cpp", "kernels/attention_isa.cpp"),
    "layers": ("cpu_layers.cpp", "kernels/layers_isa.cpp"),
    "linear": ("cpu_gemv.cpp", "kernels/gemv_amx.cpp", "kernels/gemv_avx512.cpp", "kernels/gemv_avx2.cpp",
               "cpu_gemv_f32.cpp", "kernels/gemv_f32_avx2.cpp"),
    "lora": ("cpu_lora.cpp", "kernels/lora_amx.cpp", "kernels/lora_avx512.cpp", "kernels/lora_avx2.cpp"),
    "sampling": ("cpu_sampling.cpp", "kernels/sampling_isa.cpp"),
    "ggml": ("cpu_ggml.cpp", "kernels/ggml_portable.cpp", "kernels/ggml_avx2.cpp", "kernels/ggml_q8_avx2.cpp",
             "kernels/ggml_dequant_avx2.cpp"),
    "decode": ("cpu_decode.cpp",),
    # the linear group's kernels compiled into this library too (a library cannot call into another's)
    "moe": ("cpu_moe.cpp", "kernels/gemv_amx.cpp", "kernels/gemv_avx512.cpp", "kernels/gemv_avx2.cpp",
            "kernels/gemv_f32_avx2.cpp"),
}
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# The same for every file on every machine: the baseline of the architecture (the paths above it are
# the sources' own target regions). -ffp-contract=off: no multiply-add is fused unless a source asks for
# it (the layer kernels round where PyTorch's ops round; the paths of a group then agree bit for bit).
# -fno-trapping-math: no kernel reads the floating-point exception flags, and without it GCC keeps a
# loop with a float comparison in it (exp's range checks in softmax and sampling) scalar.
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-fPIC", "-w", "-ffp-contract=off", "-fno-trapping-math",
         *(("-march=x86-64", "-mtune=generic") if X86 else ()))
ISA_CAPS = ("amx", "avx512", "avx-512", "avx2", "base", "portable")  # TOKENMILL_CPU_ISA's values


class KernelsUnavailable(RuntimeError):
    """A kernel group did not build or load under TOKENMILL_REQUIRE_KERNELS=1."""


def required() -> bool:
    """TOKENMILL_REQUIRE_KERNELS=1: a group that does not build, load, or find a path on this CPU is an
    error, not a fallback."""
    return os.environ.get("TOKENMILL_REQUIRE_KERNELS", "0") not in ("", "0")


def cache_dir() -> Path:
    """Where the built libraries live: the first of $TOKENMILL_KERNEL_CACHE, $TOKENMILL_CACHE_DIR/kernels,
    $XDG_CACHE_HOME/tokenmill/kernels, ~/.cache/tokenmill/kernels (unset or empty variables skipped).
    The image points XDG_CACHE_HOME at its cache volume."""
    if kernels := os.environ.get("TOKENMILL_KERNEL_CACHE"):
        return Path(kernels)
    if tokenmill := os.environ.get("TOKENMILL_CACHE_DIR"):
        return Path(tokenmill) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tokenmill" / "kernels"


def compiler() -> str | None:
    """The C++ compiler: $CXX (a name or a path), else g++, else c++; None when there is none."""
    wanted = os.environ.get("CXX")
    return shutil.which(wanted) if wanted else shutil.which("g++") or shutil.which("c++")


def headers() -> list[Path]:
    """Every header and included body under CSRC: a group's key covers them all."""
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".inc"))


def library_path(group: str, cxx: str | None = None, root: Path | None = None) -> Path:
    """The group's library in the cache (or `root`), named by what it is built from."""
    h = hashlib.sha256()
    for src in GROUPS[group]:
        h.update(src.encode() + (CSRC / src).read_bytes())
    for header in headers():
        h.update(str(header.relative_to(CSRC)).encode() + header.read_bytes())
    cxx = cxx or compiler() or ""
    stamp = os.stat(cxx) if cxx else None
    h.update(f"{torch.__version__}|{FLAGS}|{platform.machine()}|{cxx}|{stamp and (stamp.st_size, stamp.st_mtime_ns)}".encode())
    return (root or cache_dir()) / f"tokenmill_{group}_{h.hexdigest()[:16]}.so"


class BuildError(RuntimeError):
    """The compiler refused a source (remembered: building again would fail the same way)."""


def first_error(output: str) -> str:
    """The compiler's first error line (file:line: error: ...), or its last line."""
    for line in output.splitlines():
        if re.search(r"\berror\b", line):
            return line.strip()
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"building the CPU kernels ({what}) failed: {first_error(res.stderr)}\n{res.stderr[-2000:]}")


def compile_command(cxx: str, src: str, out: str, flags: tuple[str, ...] = FLAGS) -> list[str]:
    """The command that compiles one source of CSRC into an object file."""
    from torch.utils import cpp_extension

    common = [*flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    common += [f"-I{p}" for p in [CSRC, *cpp_extension.include_paths()]]
    return [cxx, *common, "-c", str(CSRC / src), "-o", out]


def _build(groups: list[str], cxx: str, root: Path) -> dict[str, Exception | None]:
    """Compile every source of `groups` (as many at once as this process may use cores: each spends
    most of its time in torch's headers), then link each group that compiled whole into its library
    (written atomically: a concurrent loader sees no file or a whole one). group -> None, or why not."""
    from torch.utils import cpp_extension

    outs = {g: library_path(g, cxx, root) for g in groups}
    for out in outs.values():
        out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Exception | None] = {}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        objs = {(g, s): os.path.join(tmp, f"{g}-{s.replace('/', '_')}.o") for g in groups for s in GROUPS[g]}
        workers = max(1, min(len(objs), len(os.sched_getaffinity(0))))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            jobs = {key: pool.submit(_run, compile_command(cxx, key[1], obj), key[1]) for key, obj in objs.items()}
        lib_dirs = cpp_extension.library_paths()
        link = [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in lib_dirs] + ["-lc10", "-ltorch_cpu"]
        for g in groups:
            failed = next((jobs[(g, s)].exception() for s in GROUPS[g] if jobs[(g, s)].exception()), None)
            if failed is None:
                lib = os.path.join(tmp, outs[g].name)
                try:
                    _run([cxx, "-shared", "-fopenmp", *[objs[(g, s)] for s in GROUPS[g]], *link, "-o", lib], f"linking {g}")
                    os.replace(lib, outs[g])
                except Exception as exc:  # noqa: BLE001 (a link error is the group's, not the others')
                    failed = exc
            if isinstance(failed, BuildError):
                _write_failure(outs[g], str(failed))
            result[g] = failed
    return result


def _failure_path(lib: Path) -> Path:
    return lib.with_suffix(".failed")


def _write_failure(lib: Path, text: str) -> None:
    try:
        tmp = lib.with_suffix(f".failed.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, _failure_path(lib))
    except OSError:
        pass  # a read-only cache: the next start tries again


@functools.lru_cache(maxsize=1)
def _load_all() -> dict[str, str | None]:
    """Build what is missing (once per machine) and load every group: group -> None, or why not.
    Loaded once per process (a library cannot be unloaded from torch.ops)."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return dict.fromkeys(GROUPS, "turned off by TOKENMILL_CPU_KERNELS=0")
    cap = os.environ.get("TOKENMILL_CPU_ISA", "")
    if cap and cap.lower() not in ISA_CAPS:
        raise ValueError(f"TOKENMILL_CPU_ISA={cap!r}: expected one of {', '.join(ISA_CAPS)}")
    cxx = compiler()
    root = cache_dir()
    reasons: dict[str, str | None] = {}
    todo: list[str] = []
    for g in GROUPS:
        path = library_path(g, cxx, root)
        if path.exists():
            continue
        if _failure_path(path).exists():
            text = _failure_path(path).read_text()
            reasons[g] = f"{text.splitlines()[0]} (remembered from an earlier build: delete {_failure_path(path)} to retry)"
        elif cxx is None:
            wanted = os.environ.get("CXX")
            reasons[g] = f"no C++ compiler ({wanted!r} from $CXX)" if wanted else "no C++ compiler (g++ or c++) on PATH"
        else:
            todo.append(g)
    if todo:
        log.info("building the CPU kernels (%s) into %s (once per machine, about a minute on 2 cores)",
                 ", ".join(todo), root)
        try:
            built = _build(todo, cxx, root)
        except OSError:  # the cache folder cannot be written: build for this process only
            root = Path(tempfile.mkdtemp(prefix="tokenmill-kernels-"))
            built = _build(todo, cxx, root)
        for g, exc in built.items():
            if exc is not None:
                reasons[g] = str(exc).splitlines()[0] if isinstance(exc, BuildError) else f"{type(exc).__name__}: {exc}"
    for g in GROUPS:
        if g in reasons:
            continue
        try:
            torch.ops.load_library(str(library_path(g, cxx, root if g in todo else None)))
            reasons[g] = None
        except Exception as exc:  # noqa: BLE001 (a broken library: keep the torch path)
            reasons[g] = f"{type(exc).__name__}: {exc}"
    return reasons


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16): where PyTorch's bf16
    matrix products are fast; without them they are several times slower than float32's (measured on an
    AVX2-only Zen 3: 4x at 128 rows)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def load(group: str) -> str | None:
    """None when `group`'s kernels are loaded in this process (building every group the first time on
    this machine), else why not. Under TOKENMILL_REQUIRE_KERNELS=1 a group that is not loaded raises
    KernelsUnavailable instead."""
    if group not in GROUPS:
        raise ValueError(f"unknown kernel group {group!r} (groups: {', '.join(GROUPS)})")
    reason = _load_all()[group]
    if reason is not None and required():
        raise KernelsUnavailable(f"CPU kernel group {group!r} unavailable and TOKENMILL_REQUIRE_KERNELS=1: {reason}")
    return reason


def paths() -> dict[str, str]:
    """Each group's path in this process: "AMX", "AVX-512", "AVX2", "portable" (CPUs without AVX2), or
    "off (why)"; linear and moe as "bf16 <path>, int8 <path>" where the two differ; decode "on" (it runs the
    other groups' kernels). Under TOKENMILL_REQUIRE_KERNELS=1 a group that is off, or the linear
    group without a path on this CPU, raises KernelsUnavailable."""
    out: dict[str, str] = {}
    for g in GROUPS:
        reason = load(g)
        out[g] = f"off ({reason})" if reason is not None else _path(g)
    for g in ("linear", "moe"):
        if required() and "none" in out[g]:
            raise KernelsUnavailable(f"the {g} kernels have no path on this CPU ({out[g]}; they need AVX2 and "
                                     "FMA at least) and TOKENMILL_REQUIRE_KERNELS=1")
    return out


def _path(group: str) -> str:
    ops = torch.ops.tokenmill
    if group == "decode":
        return "on"
    if group in ("linear", "moe"):
        path = ops.gemv_path if group == "linear" else ops.moe_path
        bf16, int8 = path("bf16"), path("int8")
        return bf16 if bf16 == int8 else f"bf16 {bf16}, int8 {int8}"
    return getattr(ops, f"{group}_path")()


def linear_path(kind: str) -> str:
    """The path the small-batch linear kernel of `kind` ("bf16", "int8") takes on this CPU: "AMX",
    "AVX-512", "AVX2", or "none" (also when the linear group is not loaded)."""
    if load("linear") is not None:
        return "none"
    return str(torch.ops.tokenmill.gemv_path(kind))


def describe() -> str:
    """One line for the engine-ready log: every group and its path (or why it is off)."""
    return ", ".join(f"{g}={p}" for g, p in paths().items())
