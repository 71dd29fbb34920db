"""Set the CPU thread count of the calling thread only: what the thread governor switches between steps.

Why not `torch.set_num_threads`: besides the calling thread's OpenMP and MKL counts it resizes the
process-wide pthreadpool and clears oneDNN's process-wide computation cache, while other threads of
the process may be running ops (other engines in one test process, a loading version beside the
serving one). Calling it between steps is what the governor did first, and one full test run ended in
a segfault. What a step's parallel regions read is per thread: libgomp's `nthreads-var` ICV (what
`omp_get_max_threads`, and so ATen's `parallel_for`, the C++ kernels and oneDNN's OpenMP runtime,
read) belongs to the calling thread once it sets it, and MKL's `MKL_Set_Num_Threads_Local` count
overrides MKL's global one on the calling thread. So this sets those two, through ctypes, and nothing
process-wide.

One trap: ATen initialises a thread's count lazily, on the thread's first parallel ATen op, and when
`torch.set_num_threads` was ever called in the process that initialisation calls it again (resetting
the thread's count to the process's). `torch.get_num_threads()` forces it, so `__call__` runs it first.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("tokenmill.engine")


class ThreadCountSetter:
    """`setter(n)`: the calling thread's later parallel regions (OpenMP, MKL) use n threads."""

    def __init__(self, omp_set: ctypes._CFuncPtr, mkl_set: ctypes._CFuncPtr | None) -> None:
        self._omp_set = omp_set
        self._mkl_set = mkl_set

    def __call__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"thread count must be >= 1, got {threads}")
        torch.get_num_threads()  # ATen's lazy per-thread init first, so it cannot undo what follows
        self._omp_set(threads)
        if self._mkl_set is not None:
            self._mkl_set(threads)


def per_thread_setter() -> ThreadCountSetter | None:
    """The setter for this torch build, or None (with the reason logged) where torch does not run its
    CPU ops on libgomp (another OpenMP runtime or none): the governor is then not used."""
    parallel = torch.__config__.parallel_info()
    if "ATen parallel backend: OpenMP" not in parallel:
        log.info("adaptive engine threads off: torch's parallel backend is not OpenMP")
        return None
    libdir = Path(torch.__file__).parent / "lib"
    try:
        # dlsym on torch's own library resolves to the OpenMP runtime it was loaded with (its
        # dependency), not to a second copy that a path of our choosing might load.
        core = ctypes.CDLL(str(libdir / "libtorch_cpu.so"))
        omp_set = core.omp_set_num_threads
    except (OSError, AttributeError) as exc:
        log.info("adaptive engine threads off: no omp_set_num_threads in torch's library (%s)", exc)
        return None
    omp_set.argtypes, omp_set.restype = [ctypes.c_int], None
    # MKL's C entry point takes the count by value; its lowercase and upper-case names are the Fortran
    # ones, which take a pointer. Absent in builds without MKL (then nothing to set).
    mkl_set = getattr(core, "MKL_Set_Num_Threads_Local", None)
    if mkl_set is not None:
        mkl_set.argtypes, mkl_set.restype = [ctypes.c_int], ctypes.c_int
    return ThreadCountSetter(omp_set, mkl_set)


class ThreadPin:
    """Called before each step: the stepping thread runs at the engine's own count (`count()`: the
    governor's current one, or the count fixed at start-up). Needed because the count is the thread's,
    not the engine's: another engine stepping on the same thread (benchmarks and tests run two side by
    side in one thread) leaves it at its own, and a governor's probe would otherwise leak into the other
    engine's steps. One get and, only when it differs, one set: microseconds a step."""

    def __init__(self, setter: ThreadCountSetter, count: Callable[[], int]) -> None:
        self._setter = setter
        self._count = count

    def __call__(self) -> None:
        n = self._count()
        if torch.get_num_threads() != n:
            self._setter(n)
