"""The installed package, not the source tree: a wheel built from the tracked files holds every
package module and every data file the code reads (CPU kernel sources, bench texts). The image
installs that wheel's contents and checks them from outside the source folder (Dockerfile)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .conftest import REPO, run

PACKAGES = ("engine", "server", "bench")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f]


def test_the_wheel_holds_every_package_file(tmp_path):
    src = tmp_path / "src"  # a copy of the tracked files: no build/ or egg-info left in the checkout
    for name in tracked_files():
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"),
         str(src)], cwd=tmp_path, timeout=300)  # fmt: skip
    (wheel,) = (tmp_path / "w").glob("tokenmill-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    wanted = {n for n in tracked_files() if n.split("/")[0] in PACKAGES and Path(n).suffix not in (".md",)}
    assert wanted - inside == set()
    assert {"bench/data/quality.txt", "engine/kernels/csrc/cpu_attention.cpp", "engine/kernels/csrc/isa.h",
            "engine/kernels/csrc/kernels/gemv_avx2.cpp", "engine/kernels/csrc/kernels/attention_body.inc"} <= inside
