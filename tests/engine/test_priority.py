"""Priority preemption at every limit (seats, KV blocks, the step's token budget), aging, churn and
deadlines, on the scheduler alone with a fake model (tests/engine/factories.py: a token is a
function of the whole context, so a preempted request that resumes wrongly gets other tokens)."""

from __future__ import annotations

from engine.api import Deadline, Deadlines, FinishReason, PreemptionCause
from engine.request import RequestStatus

from .factories import Clock, fake_step, make_request, make_scheduler


def run_until_done(s, clock: Clock | None = None, dt: float = 0.0, limit: int = 10_000) -> dict[str, list[int]]:
    """Step (with the context-token model) until nothing is left; returns every request's output."""
    reqs = dict(s.requests)
    for _ in range(limit):
        if not s.has_unfinished():
            break
        reqs.update(s.requests)
        fake_step(s, token=None, finish=True)
        if clock is not None:
            clock.now += dt
    assert not s.has_unfinished()
    s.blocks.check_integrity([])
    return {rid: r.output_token_ids for rid, r in reqs.items()}


def unpreempted_tokens(n_prompt: int, n_out: int, **scheduler) -> list[int]:
    s = make_scheduler(**scheduler)
    s.add(make_request("alone", n_prompt, max_tokens=n_out))
    return run_until_done(s)["alone"]


def test_seats_a_waiting_interactive_request_takes_the_least_important_seat():
    s = make_scheduler(max_num_seqs=2, prefix=False)
    s.add(make_request("batch-old", 8, priority=2, arrival=0, max_tokens=20))
    s.add(make_request("batch-new", 6, priority=2, arrival=1, max_tokens=20))
    fake_step(s, token=None)
    fake_step(s, token=None)
    s.add(make_request("vip", 5, priority=0, arrival=2, max_tokens=3))
    assert "vip" in fake_step(s, token=None)  # scheduled in the very next step
    # Both batch requests are equally unimportant; batch-new has less computed work: it gave way.
    assert s.requests["batch-new"].status == RequestStatus.WAITING
    assert s.requests["batch-old"].status == RequestStatus.RUNNING
    assert s.preemptions_by == {(2, PreemptionCause.SLOTS): 1}
    out = run_until_done(s)
    assert out["batch-new"] == unpreempted_tokens(6, 20, prefix=False)  # same tokens as never preempted
    assert out["batch-old"] == unpreempted_tokens(8, 20, prefix=False)


def test_equal_or_lower_priority_never_takes_a_seat():
    s = make_scheduler(max_num_seqs=1)
    s.add(make_request("a", 4, priority=1, arrival=0, max_tokens=50))
    fake_step(s)
    s.add(make_request("same", 4, priority=1, arrival=1))
    s.add(make_request("lower", 4, priority=2, arrival=2))
    for _ in range(5):
        assert list(fake_step(s)) == ["a"]
    assert s.num_preemptions == 0


def test_kv_blocks_a_waiting_request_takes_blocks_from_the_least_important():
    # 16 blocks of 4 tokens; two batch requests and a standard one hold 11; the interactive prompt needs 6.
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, prefix=False)
    s.add(make_request("batch-a", 20, priority=2, arrival=0, max_tokens=30))
    s.add(make_request("batch-b", 19, priority=2, arrival=1, max_tokens=30))
    s.add(make_request("std", 3, priority=1, arrival=1.5, max_tokens=30))
    fake_step(s, token=None)
    assert s.blocks.num_free_blocks == 16 - 5 - 5 - 1
    s.add(make_request("vip", 24, priority=0, arrival=2, max_tokens=2))
    assert "vip" in fake_step(s, token=None)
    assert s.requests["batch-b"].status == RequestStatus.WAITING  # least work among the least important
    assert s.requests["std"].status == RequestStatus.RUNNING and s.requests["batch-a"].status == RequestStatus.RUNNING
    assert s.preemptions_by[(2, PreemptionCause.KV)] >= 1 and (1, PreemptionCause.KV) not in s.preemptions_by
    out = run_until_done(s)
    assert out["batch-b"] == unpreempted_tokens(19, 30, prefix=False)
    assert out["batch-a"] == unpreempted_tokens(20, 30, prefix=False)


def test_budget_a_long_batch_prefill_yields_the_step_to_an_interactive_request():
    # Defaults of the engine: a 2048-token budget; a 7000-token batch prompt needs 4 steps of prefill.
    s = make_scheduler(num_blocks=4000, block_size=4, max_num_seqs=64, max_tokens=2048, prefix=False)
    s.add(make_request("long-batch", 7000, priority=2, arrival=0, max_tokens=4))
    assert fake_step(s) == {"long-batch": 2048}
    s.add(make_request("vip", 16, priority=0, arrival=1, max_tokens=4))
    steps = fake_step(s)
    # vip first; the batch prefill gets the rest of the budget, but no more than outranked_chunk_tokens
    # (256): the step that makes vip's first token is not a 2048-token step.
    assert steps["vip"] == 16 and steps["long-batch"] == 256
    assert s.requests["vip"].num_output_tokens == 1  # its first token came one step after it arrived
    for _ in range(3):  # vip's decodes: the cap holds while it runs
        assert fake_step(s, finish=True) == {"vip": 1, "long-batch": 256}
    assert "vip" not in s.requests  # it reached max_tokens
    assert fake_step(s)["long-batch"] == 2048  # alone again: the whole budget
    # A prompt as long as the budget takes the whole step: the batch prefill waits one step, counted once.
    s.add(make_request("big-vip", 2048, priority=0, arrival=2, max_tokens=1))
    steps = fake_step(s)
    assert "big-vip" in steps and "long-batch" not in steps
    assert s.preemptions_by == {(2, PreemptionCause.BUDGET): 1}
    assert s.requests["long-batch"].status == RequestStatus.RUNNING  # it kept its blocks
    out = run_until_done(s)
    assert out["long-batch"] == unpreempted_tokens(7000, 4, num_blocks=4000, max_tokens=2048, prefix=False)


def test_aging_lifts_a_starved_batch_request_above_fresh_interactive_traffic():
    clock = Clock()
    s = make_scheduler(max_num_seqs=1, aging_s=10.0, clock=clock)
    s.add(make_request("inter-0", 4, priority=0, arrival=0, max_tokens=8))
    s.add(make_request("batch", 4, priority=2, arrival=0.5, max_tokens=2))
    order = []
    for i in range(1, 60):  # a fresh interactive request arrives every second, each runs 8 steps
        clock.now = float(i)
        s.add(make_request(f"inter-{i}", 4, priority=0, arrival=clock.now, max_tokens=8))
        ran = fake_step(s, token=None, finish=True)
        order += [rid for rid in ran if rid not in order]
        if "batch" in ran:
            break
    # Waiting from t=0.5, the batch request counts as interactive from t=20.5 (2 * aging_s) and, having
    # arrived before every interactive request still waiting, runs as soon as the seat frees.
    assert 20.5 <= clock.now <= 20.5 + 8
    assert all(int(rid.split("-")[1]) <= 21 for rid in order if rid != "batch")
    assert s.num_preemptions == 0  # it waited for the seat: equal levels do not preempt


def test_no_ping_pong_between_two_requests():
    """standard preempts a running batch request; the batch one, aging, takes the seat back only once
    it is strictly better than standard's level, and then nobody preempts anybody again."""
    clock = Clock()
    s = make_scheduler(max_num_seqs=1, aging_s=10.0, clock=clock)
    s.add(make_request("batch", 4, priority=2, arrival=0, max_tokens=10_000))
    fake_step(s)
    clock.now = 1.0
    s.add(make_request("std", 4, priority=1, arrival=1, max_tokens=10_000))
    holders = []
    for t in range(1, 200):
        clock.now = float(t)
        holders.append(next(iter(fake_step(s))))
    assert holders[0] == "std"  # preempted the batch request at once
    swaps = sum(1 for a, b in zip(holders, holders[1:], strict=False) if a != b)
    assert s.num_preemptions == 2 and swaps == 1
    assert holders[-1] == "batch"  # waited 20 s (level 0 < 1), took the seat back; std (level 0 after
    # 20 s of waiting) is then equal to it and waits for the seat


def test_deadlines_queue_first_token_and_total_end_requests_and_free_blocks():
    clock = Clock()
    s = make_scheduler(max_num_seqs=1, max_tokens=8, clock=clock, prefix=False)
    s.add(make_request("runner", 4, priority=0, arrival=0, max_tokens=1000, deadlines=Deadlines(total_s=5)))
    s.add(make_request("queued", 4, priority=0, arrival=0.5, deadlines=Deadlines(queue_s=1)))
    fake_step(s)
    clock.now = 1.6
    out = s.schedule()
    assert [(r.request_id, kind) for r, kind in out.expired] == [("queued", Deadline.QUEUE)]
    assert s.requests["runner"].status == RequestStatus.RUNNING
    clock.now = 5.0
    out = s.schedule()
    assert [(r.request_id, kind) for r, kind in out.expired] == [("runner", Deadline.TOTAL)]
    assert not s.has_unfinished() and s.blocks.num_used_blocks == 0
    # First token: a 40-token prompt prefilled 8 tokens a step has started but has no token by t=7.
    s.add(make_request("slow", 40, priority=0, arrival=6, deadlines=Deadlines(queue_s=0.5, first_token_s=1)))
    clock.now = 6.0
    assert fake_step(s) == {"slow": 8}
    clock.now = 6.6  # past its queue deadline, which no longer applies: it started
    assert fake_step(s) == {"slow": 8}
    clock.now = 7.0
    out = s.schedule()
    assert [(r.request_id, kind) for r, kind in out.expired] == [("slow", Deadline.FIRST_TOKEN)]
    assert out.scheduled == [] and s.blocks.num_used_blocks == 0
    assert s.requests == {} and out.expired[0][0].finish_reason == FinishReason.TIMEOUT


def test_a_preempted_request_is_never_queue_expired():
    clock = Clock()
    s = make_scheduler(max_num_seqs=1, clock=clock)
    s.add(make_request("batch", 4, priority=2, arrival=0, max_tokens=50, deadlines=Deadlines(queue_s=1)))
    fake_step(s)
    s.add(make_request("vip", 4, priority=0, arrival=0.1, max_tokens=40))
    fake_step(s)  # vip preempts batch, which waits again
    clock.now = 3.0
    assert s.schedule().expired == [] and s.requests["batch"].status == RequestStatus.WAITING


def test_a_blocked_head_is_not_jumped():
    # The head cannot get blocks and outranks nobody; the smaller request behind it must not start.
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, prefix=False)
    s.add(make_request("holder", 8, priority=0, arrival=0, max_tokens=4))
    fake_step(s)
    s.add(make_request("head", 12, priority=1, arrival=1))
    s.add(make_request("small", 2, priority=1, arrival=2))
    assert fake_step(s) == {"holder": 1}
