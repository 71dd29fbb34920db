"""The measured speculation gate (engine/spec/gate.py), with injected step times: speculation stays on
at a batch size where its time per emitted token is lower, goes off where it is higher, and the losing
arm is measured again now and then."""

from __future__ import annotations

import pytest

from engine.config.speculative import SpeculativeConfig
from engine.sched.outputs import ScheduledRequest, SchedulerOutput
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.spec.gate import SpecGate, bucket_of


def _drive(gate: SpecGate, batch: int, step_s: dict[bool, float], tokens: dict[bool, int], steps: int) -> list[bool]:
    """`steps` decisions at `batch`, each fed back the step time of the arm it chose."""
    chosen = []
    for _ in range(steps):
        spec = gate.should_speculate(batch)
        gate.record(batch, spec, step_s[spec], tokens[spec])
        chosen.append(spec)
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_small_batch_keeps_speculating_large_batch_stops():
    gate = SpecGate(probe_every=10)
    # batch 1: weight-bound, a 5-token row costs 1.2x a 1-token step and emits 2.5 tokens on average
    small = _drive(gate, 1, {True: 0.012, False: 0.010}, {True: 3, False: 1}, 40)
    # batch 32: compute-bound, the drafts make the step 4x longer for 1.6x the tokens
    large = _drive(gate, 32, {True: 0.160, False: 0.040}, {True: 52, False: 32}, 40)
    assert small[:2] == [True, False] and large[:2] == [True, False]  # each arm measured once
    assert sum(small[2:]) >= 34 and sum(large[2:]) <= 4  # then the cheaper arm, with rare probes
    assert any(large[2:]), "the losing arm is probed again"
    spec, plain = gate.estimates(32)
    assert spec is not None and plain is not None and spec > plain
    assert gate.estimates(3) == (None, None)  # bucket 4: nothing measured


def test_the_decision_follows_a_change_in_acceptance():
    gate = SpecGate(probe_every=4)
    _drive(gate, 2, {True: 0.012, False: 0.010}, {True: 6, False: 2}, 20)  # drafts accepted: on
    assert gate.should_speculate(2) or gate.should_speculate(2)
    later = _drive(gate, 2, {True: 0.012, False: 0.010}, {True: 2, False: 2}, 60)  # now all rejected
    assert sum(later[-20:]) <= 5 and not later[-1]  # off, but for the probes (every 4th decision)


def test_scheduler_feeds_only_pure_decode_steps():
    from engine import SamplingParams
    from engine.kv.block_manager import BlockManager
    from engine.request import Request

    cfg = SchedulerConfig(4, 64, speculative=SpeculativeConfig())
    sched = Scheduler(cfg, BlockManager(8, 4, True))
    req = Request("r", [1, 2, 3], SamplingParams(), 0, 0.0, frozenset())
    prefill = SchedulerOutput([ScheduledRequest(req, 0, 3, True)])
    sched.record_step_time(prefill, 0.5, 1)
    assert sched.spec_gate.estimates(1) == (None, None)
    decode = SchedulerOutput([ScheduledRequest(req, 3, 3, True, [7, 8])])
    sched.record_step_time(decode, 0.03, 3)
    spec, plain = sched.spec_gate.estimates(1)
    assert spec == pytest.approx(0.01) and plain is None
