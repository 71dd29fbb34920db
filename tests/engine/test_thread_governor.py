"""engine/core/thread_governor.py: the steps' CPU thread count follows measured step times: down to one
thread when a probe at one is faster per token (a core taken), back when the other count wins, never
on prefill steps, and a probe that goes badly ends after one step."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest
import torch

from engine.api.sampling_params import SamplingParams
from engine.core.thread_count import ThreadCountSetter, per_thread_setter
from engine.core.thread_governor import GovernorConfig, ThreadGovernor

from .helpers import make_engine


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def governor(**kw) -> tuple[ThreadGovernor, list[int], Clock]:
    applied: list[int] = []
    clock = Clock()
    cfg = GovernorConfig(**{"high": 2, "probe_every_s": 1.0, "max_probe_every_s": 8.0, "probe_steps": 3,
                            "baseline_steps": 4, "low_probe_every_s": 2.0, "max_low_probe_every_s": 8.0,
                            **kw})  # fmt: skip
    return ThreadGovernor(cfg, applied.append, clock), applied, clock


def run(gov: ThreadGovernor, clock: Clock, ms_per_token: dict[int, float], steps: int, batch: int = 8) -> None:
    """`steps` decode steps of `batch` tokens, each taking the per-token time of the current count."""
    for _ in range(steps):
        clock.t += 0.05
        gov.observe(batch, 0, batch * ms_per_token[gov.threads] / 1e3)


def test_a_taken_core_moves_the_steps_to_one_thread_and_a_freed_one_brings_them_back():
    gov, applied, clock = governor()
    run(gov, clock, {2: 3.0, 1: 4.0}, 60)  # quiet: two threads win every probe
    assert gov.chosen == 2 and gov.probes >= 1 and gov.switches == 0 and applied[-1] == 2
    run(gov, clock, {2: 40.0, 1: 5.0}, 60)  # a hog on one core: two threads are 8x slower
    assert gov.chosen == 1 and gov.threads == 1 and gov.switches == 1
    run(gov, clock, {2: 3.0, 1: 4.0}, 200)  # the hog is gone
    assert gov.chosen == 2 and gov.threads == 2 and gov.switches == 2


def test_a_confirming_probe_doubles_the_wait_up_to_the_cap():
    gov, applied, clock = governor()
    starts = []
    for _ in range(4000):
        before = gov.probes
        run(gov, clock, {2: 3.0, 1: 4.0}, 1)
        if gov.probes > before:
            starts.append(clock.t)
    gaps = [round(b - a, 2) for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:3] == sorted(gaps[:3]) and gaps[0] < gaps[2]  # 1 s, 2 s, 4 s (plus the probe's steps)
    assert max(gaps) < 8.0 + 0.5 and gaps[-1] > 7.5  # capped at max_probe_every_s
    assert gov.switches == 0 and gov.chosen == 2


def test_a_bad_probe_ends_after_one_step():
    gov, applied, clock = governor(high=2)
    run(gov, clock, {2: 40.0, 1: 5.0}, 30)
    assert gov.chosen == 1
    probes, slow_steps = gov.probes, 0
    for _ in range(400):
        slow_steps += gov.threads == 2
        run(gov, clock, {2: 40.0, 1: 5.0}, 1)
    # every probe at two threads costs one slow step: the governor is back at one before the next step
    assert gov.probes - probes >= 3 and slow_steps == gov.probes - probes
    assert gov.threads == 1 and gov.chosen == 1


def test_at_one_thread_the_costly_probes_wait_longer():
    """Probing two threads from one costs a slow step on a crowded host: those probes start later and
    thin out to max_low_probe_every_s; a switch back to two restarts the short schedule."""
    gov, applied, clock = governor(low_probe_every_s=4.0, max_low_probe_every_s=16.0)
    while gov.chosen != 1:
        run(gov, clock, {2: 40.0, 1: 5.0}, 1)
        assert clock.t < 10
    switched_at, starts = clock.t, []
    for _ in range(2000):
        before = gov.probes
        run(gov, clock, {2: 40.0, 1: 5.0}, 1)
        if gov.probes > before:
            starts.append(clock.t)
    assert starts[0] - switched_at >= 4.0
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[0] >= 7.9 and max(gaps) <= 16.0 + 0.5 and gaps[-1] >= 15.5


def test_prefill_steps_and_small_margins_do_not_move_it():
    gov, applied, clock = governor()
    for _ in range(50):
        clock.t += 0.05
        gov.observe(0, 512, 5.0)  # a slow prefill step: ignored
        gov.observe(4, 60, 5.0)  # a mixed one: ignored
    assert gov.probes == 0 and applied == [2]  # only the first step's sync of the stepping thread
    run(gov, clock, {2: 3.0, 1: 2.8}, 100)  # one thread under 10% faster: not worth a switch
    assert gov.chosen == 2 and gov.switches == 0


def test_only_steps_of_the_same_batch_size_are_compared():
    """Per-token time falls as the batch grows: a probe whose steps ran at a bigger batch than the
    current count's must not look faster for it. Here two threads win at every size."""
    gov, applied, clock = governor()
    cost = {(2, 4): 3.0, (1, 4): 4.0, (2, 16): 1.0, (1, 16): 1.5}  # ms per token by (threads, batch)
    for i in range(600):
        clock.t += 0.05
        batch = 4 if not gov.probing else 16  # the batch grows exactly while the governor probes
        if i % 50 == 0:
            batch = 16  # now and then the current count sees the big batch too
        gov.observe(batch, 0, batch * cost[(gov.threads, batch)] / 1e3)
    assert gov.probes >= 3 and gov.switches == 0 and gov.chosen == 2


def test_the_first_step_sets_the_stepping_threads_count():
    """The stepping thread may keep another engine's count (a version swap left it at one): the first
    observed step applies the governor's count and is not compared."""
    gov, applied, clock = governor()
    assert applied == []  # construction runs on another thread: nothing applied there
    run(gov, clock, {2: 3.0, 1: 4.0}, 1)
    assert applied == [2] and gov.probes == 0
    run(gov, clock, {2: 3.0, 1: 4.0}, 3)
    assert applied == [2]


def test_config_is_checked():
    with pytest.raises(ValueError, match="low < high"):
        ThreadGovernor(GovernorConfig(high=1), lambda n: None)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_engine_switches_threads_between_steps_and_output_is_unchanged(build_model, restore_threads):
    """The real engine on a worker thread, as the server runs it: a governor that probes at once
    switches that thread's count (what ATen's parallel regions and MKL read there) during generation,
    the main thread's count never moves, and the greedy tokens equal a fixed-thread run's."""
    torch.set_num_threads(2)
    path = build_model("tiny-llama")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    fixed = make_engine(path, cpu_threads=2).generate([[11, 12, 13], [5, 6]], params)
    engine = make_engine(path, cpu_threads=2, adaptive_threads=True)
    gov = engine.thread_governor
    assert gov is not None and gov.config.high == 2 and isinstance(gov._apply, ThreadCountSetter)
    seen: list[tuple[int, int, int]] = []
    mkl_max = _mkl_max_threads()

    def apply(n: int) -> None:  # the engine's setter, then what this thread's parallel regions will use
        gov_setter(n)
        seen.append((n, torch.get_num_threads(), mkl_max() if mkl_max else n))

    gov_setter = gov._apply
    cfg = GovernorConfig(high=2, probe_every_s=0.0, low_probe_every_s=0.0, probe_steps=2, baseline_steps=2,
                         margin=-10.0, abort_ratio=1e9)  # always switch
    engine.thread_governor = ThreadGovernor(cfg, apply)
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(engine.generate([[11, 12, 13], [5, 6]], params)))
    worker.start()
    worker.join()
    assert [r.token_ids for r in out] == [r.token_ids for r in fixed]
    assert (1, 1, 1) in seen and (2, 2, 2) in seen and engine.stats().cpu_thread_switches >= 2
    assert engine.stats().cpu_threads == engine.thread_governor.threads
    assert torch.get_num_threads() == 2  # the main thread was never switched
    assert make_engine(path, cpu_threads=1, adaptive_threads=True).thread_governor is None  # nothing to choose


def test_the_setter_changes_the_calling_thread_only(restore_threads):
    """torch.set_num_threads is process-wide in part (it resizes shared pools); the governor's setter
    must touch only the thread that calls it, and survive ATen's lazy per-thread initialisation."""
    torch.set_num_threads(2)
    setter = per_thread_setter()
    assert setter is not None  # torch's CPU build runs on libgomp
    mkl_max = _mkl_max_threads()
    set_done, checked = threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def other() -> None:
        setter(1)  # first thing on a fresh thread: ATen's lazy init must not undo it afterwards
        torch.ones(4096).sum()  # a parallel op
        seen["other"], seen["other_mkl"] = torch.get_num_threads(), mkl_max() if mkl_max else 1
        set_done.set()
        checked.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert set_done.wait(10)
    seen["main"] = torch.get_num_threads()  # while the other thread still runs at one
    checked.set()
    t.join()
    assert seen == {"other": 1, "other_mkl": 1, "main": 2}
    with pytest.raises(ValueError, match=">= 1"):
        setter(0)


def _mkl_max_threads():
    """MKL's thread count for the calling thread (None in builds without MKL)."""
    core = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    fn = getattr(core, "MKL_Get_Max_Threads", None)
    if fn is not None:
        fn.argtypes, fn.restype = [], ctypes.c_int
    return fn


def test_no_governor_in_the_batch_invariant_mode(build_model, restore_threads):
    path = build_model("tiny-llama")
    engine = make_engine(path, cpu_threads=2, adaptive_threads=True, dtype="float32", deterministic=True)
    assert engine.thread_governor is None


def test_two_engines_on_one_thread_each_step_at_their_own_count(build_model, restore_threads):
    """The count is the thread's: a governed engine's probe at one thread must not leak into the steps
    of another engine that steps on the same thread (benchmarks run two side by side), nor theirs into
    its own: each step starts at its engine's count (ThreadPin)."""
    from engine.core.thread_count import ThreadPin

    torch.set_num_threads(2)
    path = build_model("tiny-llama")
    governed = make_engine(path, cpu_threads=2, adaptive_threads=True)
    fixed = make_engine(path, cpu_threads=2, adaptive_threads=False)
    assert governed.thread_governor is not None and fixed.thread_governor is None
    seen: dict[str, list[int]] = {"governed": [], "fixed": []}
    for name, engine in (("governed", governed), ("fixed", fixed)):
        inner = engine.runner.execute

        def execute(sched, inner=inner, name=name):
            seen[name].append(torch.get_num_threads())
            return inner(sched)

        engine.runner.execute = execute
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    gov = governed.thread_governor
    gov._set(1)
    gov._chosen = 1  # as after a switch to one thread (its next probe of two is seconds away)
    governed.generate([[11, 12, 13]], params)
    fixed.generate([[11, 12, 13]], params)
    governed.generate([[5, 6]], params)
    assert seen["fixed"] and set(seen["fixed"]) == {2}
    assert seen["governed"] and set(seen["governed"]) == {1}
    assert isinstance(fixed.thread_pin, ThreadPin) and isinstance(governed.thread_pin, ThreadPin)
