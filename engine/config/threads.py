"""How many CPU threads the engine gets by default (what `cpu_threads` defaults to in the server): the
cores this process may run on, as the OS and a container's cgroup limit them. Setting them is
engine/core/thread_count.py's job, choosing between counts per step engine/core/thread_governor.py's."""

from __future__ import annotations

import math
import os


def default_engine_threads() -> int:
    """OMP_NUM_THREADS when set, else one thread per core this process may run on, but one core left to
    the event loop, tokenization and HTTP above 4 cores. On 2 cores both threads pay: the engine is
    bound by memory bandwidth, which a second core nearly doubles, while the HTTP side needs a few
    percent of a core (docs/benchmarks/log.md, "Thread placement"; measured on 2 cores only, the rule above
    4 is the cautious choice, not a measurement). The engine's OpenMP team must be the process's only
    one for this to hold: server/serving/fresh_thread.py."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:  # a container limited to N CPUs sees every host core in its affinity mask
        cores = min(cores, quota)
    return cores if cores <= 4 else cores - 1


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def cgroup_cpu_quota(path: str | None = None) -> int | None:
    """The CPUs this process's cgroup may use (quota / period, rounded up), None when unlimited or
    unknown (no cgroup v2, a malformed file). `docker run --cpus 2` and a Kubernetes CPU limit set it."""
    try:
        with open(path or CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None
