"""Speculation never delays a more important lane (engine/sched/scheduler.py, `_StepPlanner.spec_level`): while
an interactive request waits, prefills or decodes, batch-lane rows carry no drafts, so they neither
take step budget it needs nor lengthen its steps; the interactive request itself speculates, the batch
rows speculate again once it is gone, and every output is still non-speculative greedy (float32)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.api import PreemptionCause
from engine.sched.outputs import SchedulerOutput

from .helpers import Case, make_case, make_engine, spec_engine
from .test_speculative import SPEC, OracleProposer, _run

BUDGET = 64  # max_num_batched_tokens: the interactive prompt (100 tokens) needs two steps of it
BATCH, INTERACTIVE = 2, 0


@pytest.fixture(scope="module")
def lanes(build_model):
    from transformers import AutoConfig

    path = build_model("tiny-llama")
    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    case = make_case(vocab, n=4, seed=11)
    # three batch requests with short prompts, one interactive request with a 100-token prompt
    prompts = [(case.prompts[i] * 40)[:20] for i in range(3)] + [(case.prompts[3] * 100)[:100]]
    case = Case(prompts, [40, 40, 40, 24])
    return path, vocab, case, _run(make_engine(path), case)


def _recording_engine(path, vocab, ref, **kw):
    engine = spec_engine(path, speculative=SPEC, max_num_batched_tokens=BUDGET, **kw)
    engine.scheduler.proposer = OracleProposer({f"r{i}": r for i, r in enumerate(ref)}, vocab)
    steps: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    engine.scheduler.schedule = recorded
    return engine, steps


@pytest.mark.parametrize("seats", [8, 3])
def test_batch_rows_do_not_speculate_while_an_interactive_request_is_present(lanes, seats):
    """seats 3: the batch rows fill them, so the interactive request arrives to take one (a batch row
    is preempted in that step and recomputed later)."""
    path, vocab, case, ref = lanes
    engine, steps = _recording_engine(path, vocab, ref, max_num_seqs=seats)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}

    def step() -> None:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        engine.check_integrity()

    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i],
                           params=SamplingParams(max_tokens=case.max_tokens[i], temperature=0.0), priority=BATCH)  # fmt: skip
    for _ in range(3):
        step()
    assert any(s.draft_token_ids for s in steps[-1].scheduled), "the batch rows speculate while alone"
    before = len(steps)
    engine.add_request("r3", prompt_token_ids=case.prompts[3],
                       params=SamplingParams(max_tokens=case.max_tokens[3], temperature=0.0), priority=INTERACTIVE)  # fmt: skip
    while engine.scheduler.requests.get("r3") is not None:
        step()
    with_interactive = steps[before:]
    # its prompt runs at once: the whole budget, then the rest
    first = [s for s in with_interactive[0].scheduled if s.request.request_id == "r3"]
    assert [s.num_tokens for s in first] == [BUDGET]
    second = [s for s in with_interactive[1].scheduled if s.request.request_id == "r3"]
    assert [s.num_tokens for s in second] == [100 - BUDGET]
    for out in with_interactive:
        batch_drafts = [s.draft_token_ids for s in out.scheduled if s.request.priority == BATCH]
        assert not any(batch_drafts), "a batch row speculated in a step with an interactive request"
    own = [s for out in with_interactive for s in out.scheduled if s.request.request_id == "r3" and s.draft_token_ids]
    assert own, "the interactive request speculates itself"
    batch_ran = [s for out in with_interactive for s in out.scheduled if s.request.priority == BATCH]
    assert batch_ran, "the batch rows kept decoding beside it (without drafts)"
    after = len(steps)
    while engine.has_unfinished():
        step()
    assert any(s.draft_token_ids for out in steps[after:] for s in out.scheduled), "batch rows speculate again"
    assert [got[f"r{i}"] for i in range(4)] == ref
    assert engine.stats().kv_blocks_used == 0
    slots = engine.stats().preemptions_by.get((BATCH, PreemptionCause.SLOTS), 0)
    assert slots == (1 if seats == 3 else 0)


# ---- the rule on the scheduler alone (no model) ------------------------------------------------------
class _Constant:
    def propose(self, req, k):
        return [5] * k


def _drafting(sched, steps: int = 3) -> dict[str, int]:
    """Run `steps` fake steps (every draft accepted, plus one token); request_id -> tokens scheduled in
    the last one, and how many of them were drafts."""
    drafts: dict[str, tuple[int, int]] = {}
    for _ in range(steps):
        out = sched.schedule()
        sched.advance(out)
        drafts = {}
        for s in out.scheduled:
            if s.sample:
                s.request.output_token_ids.extend([*s.draft_token_ids, 7])
            if s.draft_token_ids:
                sched.settle_drafts(s, len(s.draft_token_ids))
            drafts[s.request.request_id] = (s.num_tokens, len(s.draft_token_ids))
    return drafts


def _spec_scheduler(aging_s: float = 0.0, clock=None):
    from engine.kv.block_manager import BlockManager
    from engine.sched.scheduler import Scheduler, SchedulerConfig
    from engine.spec.drafts import SpeculativeConfig

    from .factories import Clock

    cfg = SchedulerConfig(8, 64, aging_s, speculative=SpeculativeConfig(num_speculative_tokens=3))
    sched = Scheduler(cfg, BlockManager(64, 4, True), clock or Clock())
    sched.spec_gate, sched.proposer = None, _Constant()
    return sched


def test_the_most_important_level_present_speculates():
    """standard (1) beside batch (2): standard drafts, batch does not; with an interactive (0) request
    waiting, neither does standard, and the interactive one drafts once it decodes."""
    from .factories import make_request

    sched = _spec_scheduler()
    sched.add(make_request("std", 6, priority=1, max_tokens=40))
    sched.add(make_request("bat", 6, priority=2, max_tokens=40))
    assert _drafting(sched) == {"std": (4, 3), "bat": (1, 0)}
    sched.add(make_request("int", 6, priority=0, max_tokens=40, tokens=[300 + j for j in range(6)]))  # no cached prefix
    assert _drafting(sched, 1) == {"int": (6, 0), "std": (1, 0), "bat": (1, 0)}  # its prompt: no drafts beside it
    assert _drafting(sched, 2) == {"int": (4, 3), "std": (1, 0), "bat": (1, 0)}


def test_an_aged_batch_request_speculates_at_its_effective_level():
    """aging lifts a batch request that waited two aging periods to level 0: it speculates beside an
    interactive request (the rule reads effective priorities, as the rest of the ordering does)."""
    from .factories import Clock, make_request

    clock = Clock(0.0)
    sched = _spec_scheduler(aging_s=1.0, clock=clock)
    sched.add(make_request("bat", 6, priority=2, arrival=0.0, max_tokens=40))
    clock.now = 2.5  # it started late: waited 2.5 s, two levels
    sched.add(make_request("int", 6, priority=0, arrival=2.5, max_tokens=40))
    assert _drafting(sched) == {"bat": (4, 3), "int": (4, 3)}
