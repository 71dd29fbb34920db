"""Every kernel source compiles for every x86-64 CPU kind, whatever CPU runs the tests.

The kernels are built with the same portable flags everywhere (engine/kernels/cpu_kernels.py FLAGS) and pick
their path at run time, so the code for an instruction set must sit in functions (or `#pragma GCC
target` regions) that carry its target: an AMX or AVX-512 intrinsic in a lambda, say, compiles on a
CPU whose default target has it and nowhere else. This compiles each source of engine/kernels/csrc/kernels/
(where every intrinsic lives, without torch's headers, so a build takes a second) for several -march
targets, with code generation on (-O0 -c: -fsyntax-only misses the inlining errors), and checks that
the files around them (the groups' bindings, which include torch) hold no intrinsic at all."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.kernels import cpu_kernels

CXX = shutil.which("g++")
if CXX is None and shutil.which("c++") is None:
    pytest.skip("no C++ compiler", allow_module_level=True)
CXX = CXX or shutil.which("c++")

KERNELS = cpu_kernels.CSRC / "kernels"
# The CPU kinds seen on these machines and their neighbours: an AVX2-only Zen 3, a Zen 4 (GCC 12 has no
# znver4: Zen 3 with Zen 4's AVX-512 extensions), an AVX-512 Xeon without AMX, a Xeon with AMX, and the
# x86-64 baselines.
TARGETS = {
    "x86-64-v2": ["-march=x86-64-v2"],
    "x86-64-v3": ["-march=x86-64-v3"],
    "znver3": ["-march=znver3"],
    "zen4": ["-march=znver3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd", "-mavx512bf16",
             "-mavx512vnni", "-mavx512ifma", "-mavx512vbmi"],
    "icelake-server": ["-march=icelake-server"],
    "sapphirerapids": ["-march=sapphirerapids"],
}
INTRINSICS = re.compile(r"\b(_mm\d*_\w+|__m(64|128|256|512)\w*|_tile_\w+|__tile\w*)|immintrin\.h|x86intrin\.h")


def _flags(target: list[str]) -> list[str]:
    """The build's flags with the target's -march in place of the baseline's, and no optimisation (the
    inlining checks run at -O0 too, at a fraction of the time)."""
    keep = [f for f in cpu_kernels.FLAGS if not f.startswith(("-march", "-mtune", "-O"))]
    return ["-O0", *keep, *target]


def _compile(src: Path, target: list[str], out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CXX, *_flags(target), f"-I{KERNELS}", "-c", str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=600)


def test_every_kernel_source_compiles_for_every_target(tmp_path):
    sources = sorted(KERNELS.glob("*.cpp"))
    grouped = {s for srcs in cpu_kernels.GROUPS.values() for s in srcs}
    assert {f"kernels/{s.name}" for s in sources} <= grouped, "a kernel source that no group builds"
    jobs = [(src, name, flags) for src in sources for name, flags in TARGETS.items()]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda j: (j, _compile(j[0], j[2], tmp_path / f"{j[0].stem}-{j[1]}.o")), jobs))
    failed = [f"{src.name} for {name}: {cpu_kernels.first_error(res.stderr)}" for (src, name, _), res in results
              if res.returncode != 0]
    assert not failed, "\n".join(failed)


def test_intrinsics_live_only_in_kernels_and_kernels_do_not_include_torch():
    """The bindings are compiled only on the machine that runs them: an intrinsic there would escape the
    test above. The kernels include no torch header (they compile in a second, for every target)."""
    for path in sorted(cpu_kernels.CSRC.glob("*")):
        if path.suffix in (".cpp", ".h", ".inc"):
            text = re.sub(r"//[^\n]*", "", path.read_text())  # comments may name them
            assert not INTRINSICS.search(text), f"{path.name} uses an intrinsic outside engine/kernels/csrc/kernels/"
    for path in sorted(KERNELS.glob("*")):
        text = path.read_text()
        assert not re.search(r'#include\s*[<"](ATen|torch|c10)/', text), f"kernels/{path.name} includes torch"


def test_an_amx_intrinsic_in_a_lambda_fails_here(tmp_path):
    """The check above catches the December bug: an AMX intrinsic called in a lambda inside a function
    with the AMX target builds where the default target has AMX and fails everywhere else."""
    src = tmp_path / "lambda.cpp"
    src.write_text(
        "#include <immintrin.h>\n"
        '__attribute__((target("amx-tile"))) void work() {\n'
        "  auto done = [] { _tile_release(); };\n"
        "  done();\n"
        "}\n"
    )
    res = _compile(src, TARGETS["x86-64-v3"], tmp_path / "lambda.o")
    assert res.returncode != 0 and "_tile_release" in res.stderr
    assert _compile(src, TARGETS["sapphirerapids"], tmp_path / "lambda-spr.o").returncode == 0
