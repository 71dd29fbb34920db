"""Fair share between tenants (engine/sched/fair_share.py): the counter on its own, then in the scheduler."""

from __future__ import annotations

import dataclasses

import pytest

from engine.request import RequestStatus
from engine.sched.fair_share import FairShare
from engine.sched.scheduler import Scheduler, SchedulerConfig

from .factories import fake_step, make_request, make_scheduler

# ---- the counter -----------------------------------------------------------------------------------


def test_charge_weighs_prompt_and_output_tokens_and_divides_by_the_weight():
    f = FairShare({"a": 2.0}, prompt_weight=1.0, output_weight=2.0)
    f.arrived("a")
    f.arrived("b")
    f.charge("a", 10, 3)  # (10 + 6) / 2
    f.charge("b", 10, 3)  # (10 + 6) / 1
    assert f.counter("a") == 8.0
    assert f.counter("b") == 16.0


def test_a_tenant_that_becomes_active_starts_at_the_least_served_active_tenant():
    f = FairShare()
    f.arrived("a")
    f.arrived("b")
    f.charge("a", 100, 0)
    f.charge("b", 40, 0)
    f.arrived("c")  # new: lifted to min(100, 40), not 0 (no credit for never having asked)
    assert f.counter("c") == 40.0


def test_idle_time_is_not_banked():
    f = FairShare()
    f.arrived("a")
    f.arrived("b")
    f.charge("a", 500, 0)
    f.left("b")  # b goes idle with 0 while a keeps being served
    f.charge("a", 500, 0)
    f.arrived("b")  # back: lifted to a's 1000, so it does not get 1000 tokens in a row
    assert f.counter("b") == 1000.0
    f.left("a")
    f.left("b")
    f.arrived("a")  # nobody was active: everyone restarts level
    assert f.counter("a") == 0.0 and f.counter("b") == 0.0


def test_a_returning_tenant_keeps_a_higher_counter_than_the_minimum():
    f = FairShare()
    f.arrived("a")
    f.arrived("b")
    f.charge("b", 300, 0)
    f.left("b")
    f.arrived("b")  # was ahead of a: stays ahead (a lift never lowers)
    assert f.counter("b") == 300.0


def test_weight_changes_apply_to_future_service_only():
    f = FairShare({"a": 1.0})
    f.arrived("a")
    f.charge("a", 100, 0)
    f.set_weights({"a": 4.0})
    f.charge("a", 100, 0)
    assert f.counter("a") == 125.0  # 100 / 1 + 100 / 4
    f.set_weights({})  # a reload that drops it: weight 1 again
    assert f.weight("a") == 1.0


@pytest.mark.parametrize("weights", [{"a": 0}, {"a": -1.0}, {"a": float("nan")}, {"a": "2"}])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError, match="tenant weights"):
        FairShare(weights)


def test_outranks_moves_a_seat_only_while_the_split_is_unfair():
    f = FairShare(max_seats=4)
    for t in ("a", "a", "a", "a", "b"):
        f.arrived(t)
    for _ in range(4):
        f.seated("a")
    assert f.seat_share("a") == 2.0 and f.seat_share("b") == 2.0
    assert f.outranks("b", "a")  # a holds 4 of 4
    f.unseated("a")
    f.seated("b")
    assert f.outranks("b", "a")  # 3 vs 1: still over
    f.unseated("a")
    f.seated("b")
    assert not f.outranks("b", "a") and not f.outranks("a", "b")  # 2 and 2: settled, no move back
    assert not f.outranks("a", "a")
    assert not FairShare(max_seats=None).outranks("b", "a")


def test_weighted_seat_shares_do_not_trade_back():
    f = FairShare({"a": 2.0}, max_seats=8)  # shares 5.33 / 2.67
    f.arrived("a")
    f.arrived("b")
    for t, n in (("a", 6), ("b", 2)):
        for _ in range(n):
            f.seated(t)
    assert not f.outranks("b", "a")  # b would hold 3 > 2.67
    assert not f.outranks("a", "b")  # b would hold 1 < 2.67


# ---- in the scheduler ---------------------------------------------------------------------------------


def _tenant_request(rid: str, tenant: str, n_prompt: int = 4, priority: int = 1, arrival: float = 0.0,
                    max_tokens: int = 8):  # fmt: skip
    return dataclasses.replace(make_request(rid, n_prompt, priority, arrival, max_tokens), tenant=tenant)


def _scheduler(max_num_seqs: int, weights=(), seats: bool = True, num_blocks: int = 4096) -> Scheduler:
    s = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_tokens=4096, prefix=False)
    cfg = SchedulerConfig(max_num_seqs, 4096, tenant_weights=tuple(weights), fair_seats=seats)
    return Scheduler(cfg, s.blocks, s.clock)


def _run(s: Scheduler, steps: int, refill=None) -> dict[str, int]:
    """Step `steps` times, finishing requests at max_tokens; generated tokens by tenant. `refill(tenant)`
    is called for each finished request, to keep its tenant backlogged."""
    generated: dict[str, int] = {}
    for _ in range(steps):
        out = s.schedule()
        s.advance(out)
        for sr in out.scheduled:
            req = sr.request
            if not sr.sample:
                continue
            req.output_token_ids.append(7)
            generated[req.tenant] = generated.get(req.tenant, 0) + 1
            if req.num_output_tokens >= req.params.max_tokens:
                from engine.api import FinishReason

                s.finish(req, FinishReason.LENGTH)
                if refill is not None:
                    refill(req.tenant)
    return generated


def _backlog(s: Scheduler, counts: dict[str, int], max_tokens: int = 16):
    """Queue counts[t] requests per tenant, and a refill that queues one more each time one finishes."""
    serial = {"n": 0}

    def add(tenant: str) -> None:
        serial["n"] += 1
        s.add(_tenant_request(f"{tenant}{serial['n']}", tenant, arrival=float(serial["n"]), max_tokens=max_tokens))

    for tenant, n in counts.items():
        for _ in range(n):
            add(tenant)
    return add


def test_ties_between_tenants_go_by_arrival():
    s = _scheduler(max_num_seqs=1)
    s.add(_tenant_request("b-late", "B", arrival=5))
    s.add(_tenant_request("a-early", "A", arrival=1))
    assert s.fair.counter("A") == s.fair.counter("B") == 0.0
    assert list(fake_step(s)) == ["a-early"]


def test_with_one_tenant_the_order_is_unchanged():
    s = _scheduler(max_num_seqs=1)
    s.add(_tenant_request("late", "", arrival=5))
    s.add(_tenant_request("early", "", arrival=1))
    assert list(fake_step(s)) == ["early"]


def test_the_least_served_tenant_gets_the_next_seat_over_an_earlier_arrival():
    s = _scheduler(max_num_seqs=2)
    _backlog(s, {"A": 6})  # A arrives first with six
    add_b = _backlog(s, {})
    _run(s, 3)  # two of A's run; A is served
    add_b("B")  # B arrives last
    for r in list(s.running):
        from engine.api import FinishReason

        s.finish(r, FinishReason.LENGTH)  # the seats free up
    assert any(r.tenant == "B" for r in (s.requests[i] for i in fake_step(s)))


def test_two_backlogged_tenants_share_generated_tokens_evenly():
    s = _scheduler(max_num_seqs=8)
    refill = _backlog(s, {"A": 48, "B": 48})
    got = _run(s, 600, refill)
    share = got["A"] / (got["A"] + got["B"])
    assert 0.45 <= share <= 0.55, got


def test_weights_two_to_one_give_two_thirds():
    s = _scheduler(max_num_seqs=8, weights=(("A", 2.0),))
    refill = _backlog(s, {"A": 48, "B": 48})
    got = _run(s, 600, refill)
    share = got["A"] / (got["A"] + got["B"])
    assert 0.60 <= share <= 0.73, got


def test_without_fair_share_the_big_tenant_takes_the_seats():
    """The control: the counter is what changes the share (arrival order alone gives A nearly all)."""
    s = _scheduler(max_num_seqs=8)
    s.policy = dataclasses.replace(s.policy, fair=None)
    s.waiting._policy = s.policy
    refill = _backlog(s, {"A": 48, "B": 4})
    got = _run(s, 300, refill)
    assert got.get("B", 0) / (got["A"] + got.get("B", 0)) < 0.2, got


def test_a_small_tenant_takes_a_seat_from_a_big_one_within_a_step():
    """A holds every seat with long requests and 40 more queued; B's request starts in the step it
    arrives (it takes the seat of A's least advanced request), instead of waiting for one of A's to end."""
    s = _scheduler(max_num_seqs=8)
    _backlog(s, {"A": 48}, max_tokens=200)
    _run(s, 20)
    add = _backlog(s, {})
    add("B")
    b = next(r for r in s.requests.values() if r.tenant == "B")
    fake_step(s)
    assert b.status == RequestStatus.RUNNING
    victims = [r for r in s.requests.values() if r.tenant == "A" and r.num_preemptions]
    assert len(victims) == 1
    s.blocks.check_integrity(s.requests.values())


def test_the_step_that_seats_a_small_tenant_caps_a_big_tenants_prefill_chunk():
    """A holds every seat, one of them a long prompt being prefilled a budget at a time. The step that
    seats B's request (B under its seat share) gives A's prefill at most outranked_chunk_tokens, so B's
    first token is not behind a whole budget of A's prompt; alone again, A's prefill takes the budget."""
    s = make_scheduler(num_blocks=4096, max_num_seqs=4, max_tokens=2048, prefix=False)
    cap = s.config.outranked_chunk_tokens
    assert cap == 256
    for i in range(3):
        s.add(_tenant_request(f"a{i}", "A", arrival=i, max_tokens=100))
    s.add(_tenant_request("a-long", "A", n_prompt=12000, arrival=3, max_tokens=4))
    first = fake_step(s)
    assert first["a-long"] == 2048 - 3 * 4
    assert fake_step(s)["a-long"] == 2048 - 3  # A alone: its prefill takes what the decodes leave
    s.add(_tenant_request("b", "B", arrival=10, max_tokens=4))
    step = fake_step(s)
    assert step["b"] == 4  # seated at once (a seat of A's, by preemption)
    assert step["a-long"] == cap, step
    for _ in range(3):  # B decoding beside it: still capped
        step = fake_step(s, finish=True)
        assert step["a-long"] == cap, step
    assert "b" not in s.requests
    assert fake_step(s)["a-long"] > cap  # B gone: the whole budget again


def test_seats_do_not_ping_pong_between_tenants():
    s = _scheduler(max_num_seqs=8)
    refill = _backlog(s, {"A": 48, "B": 48}, max_tokens=64)
    for _ in range(800):
        _run(s, 1, refill)
        assert s.fair.seats("A") <= 4 and s.fair.seats("B") <= 4  # (0 + 0 right after all 8 ended together)
    # seats freed together (every 64 steps all 8 end at once) are dealt by share, not all to the least
    # served tenant (which the other would then take back by preemption)
    assert s.num_preemptions == 0, s.num_preemptions


def test_an_idle_tenant_that_returns_gets_no_burst():
    s = _scheduler(max_num_seqs=8)
    refill = _backlog(s, {"A": 48, "B": 48})
    _run(s, 200, refill)
    # B goes idle: its queued requests end; A alone for a long time
    from engine.api import FinishReason

    for r in [r for r in s.requests.values() if r.tenant == "B"]:
        s.finish(r, FinishReason.ABORT)
    _run(s, 400, lambda t: refill(t) if t == "A" else None)
    refill_b = _backlog(s, {"B": 48})
    got = _run(s, 200, lambda t: (refill if t == "A" else refill_b)(t))
    share_b = got["B"] / (got["A"] + got["B"])
    assert share_b <= 0.6, got  # no catch-up for the 400 steps it was away


def test_prefix_hits_are_not_charged():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens=64, prefix=True)
    tokens = list(range(100, 116))
    s.add(dataclasses.replace(make_request("a", 16, tokens=tokens, max_tokens=1), tenant="T"))
    _run(s, 2)
    first = s.fair.counter("T")
    s.add(dataclasses.replace(make_request("b", 16, tokens=tokens, max_tokens=1), tenant="T"))
    _run(s, 2)
    # the second computes only what the cache lacks (the last block: it must sample) and one token
    assert s.fair.counter("T") - first < first
