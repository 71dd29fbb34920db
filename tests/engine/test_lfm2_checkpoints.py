"""Prefix reuse across turns for a hybrid model (LFM2) through state checkpoints (engine/state/checkpoints.py,
checkpoint_store.py): turn 2 (and 3) of a chat resumes from the checkpoint at the end of the previous
turn's prompt + answer (cached tokens reported), with transformers' greedy tokens and the same tokens as
without checkpoints; the fallback to the longest prefix whose KV blocks and checkpoint both exist; a tiny
checkpoint pool evicting under pressure; KV preemption, aborts mid-prefill and a failed step leaving the
pools consistent and no half-written checkpoint findable."""

from __future__ import annotations

import pytest
import torch

from engine.api import FinishReason
from engine.state.checkpoints import CheckpointIndex
from engine.state.pool import StatePool

from .factories import fake_step, make_request, make_scheduler
from .helpers import Case, greedy, hf_reference, make_engine

PRESET = "tiny-lfm2"
BS = 16  # block size of these tests: checkpoints sit at multiples of it
# turn-1 prompt lengths (96: a whole number of blocks) and answer lengths; the new user tokens of turn 2 and 3
FIRST = [150, 37, 96, 201]
ANSWER = [20, 40, 16, 3]
USER2 = [37, 5, 60, 16]
USER3 = [21, 40, 9, 33]
NEXT = 12  # tokens generated in turns 2 and 3


def _random(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(10, 2048, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def chats(build_model):
    """Four conversations of three turns: each turn's prompt is the previous prompt + its answer + new
    user tokens; every turn's greedy answers from transformers (float32): refs[turn] is a Reference
    (tokens and their log-probabilities)."""
    path = build_model(PRESET)
    g = torch.Generator().manual_seed(42)
    turns, refs = [[_random(g, n) for n in FIRST]], []
    for lengths, users in ((ANSWER, USER2), (NEXT, USER3), (NEXT, None)):
        width = lengths if isinstance(lengths, list) else [lengths] * len(FIRST)
        ref = hf_reference(path, Case(turns[-1], width))
        refs.append(ref)
        if users is not None:
            turns.append([p + a + _random(g, u) for p, a, u in zip(turns[-1], ref.token_ids, users, strict=True)])
    return path, turns, refs


def run_turns(engine, turns, refs, check_every_step: bool = False) -> list[list]:
    """Each turn's prompts at once (batched), turn after turn, each answer checked against transformers'
    (tokens, and log-probabilities within 1e-4: a resumed state that is slightly off shows there before
    it flips a greedy token); returns each turn's results."""
    results = []
    for t, prompts in enumerate(turns):
        width = ANSWER if t == 0 else [NEXT] * len(prompts)
        if check_every_step:
            got = stepwise(engine, prompts, width)
        else:
            got = engine.generate(prompts, [greedy(m, logprobs=0) for m in width])
        for i, r in enumerate(got):
            assert_matches(r, refs[t], i, f"turn {t + 1}, conversation {i}")
        results.append(got)
    return results


def assert_matches(result, ref, i: int, what: str = "") -> None:
    """result's tokens are transformers' (ref.token_ids[i]), its log-probabilities within 1e-4."""
    assert result.token_ids == ref.token_ids[i], f"{what}: tokens differ from transformers"
    got = [lp.logprob for lp in result.logprobs]
    assert len(got) == len(ref.logprobs[i]), what
    assert max((abs(a - b) for a, b in zip(got, ref.logprobs[i], strict=True)), default=0.0) < 1e-4, what


def stepwise(engine, prompts, max_tokens):
    """generate(), checking every pool's integrity after each step."""
    from engine.core.step_loop import GenerationResult

    out = {}
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"s{id(out)}-{i}", prompt_token_ids=p, params=greedy(m, logprobs=0))
        out[f"s{id(out)}-{i}"] = GenerationResult(f"s{i}", p, [], "", None)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].token_ids.extend(o.new_token_ids)
            out[o.request_id].logprobs.extend(o.logprobs or [])
            out[o.request_id].cached_tokens = o.cached_tokens
        engine.check_integrity()
    return list(out.values())


def assert_released(engine) -> None:
    """Idle: nothing held in the KV, state or checkpoint pools, every invariant holds."""
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0 and engine.state_pool.num_used == 0
    assert engine.checkpoints.num_held == 0


def expected_resume(prompt_len: int, answer_len: int) -> int:
    """The end of the previous turn's prompt + answer (its computed tokens: the last token sampled is
    not) aligned down to a block boundary."""
    return (prompt_len + answer_len - 1) // BS * BS


@pytest.mark.parametrize("budget", [512, 7])
def test_next_turns_resume_from_checkpoints_with_transformers_tokens(chats, budget):
    """Turns 2 and 3 start from the checkpoint at the end of the previous turn (cached_tokens) and give
    transformers' tokens; with 7-token steps the resumed prefill is also cut anywhere after the resume."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=budget)
    assert engine.block_manager.enable_prefix_caching and engine.checkpoints is not None
    results = run_turns(engine, turns, refs)
    assert [r.cached_tokens for r in results[0]] == [0] * 4
    for t in (1, 2):
        prev_len = [len(p) for p in turns[t - 1]]
        want = [expected_resume(n, len(a)) for n, a in zip(prev_len, refs[t - 1].token_ids, strict=True)]
        assert [r.cached_tokens for r in results[t]] == want
    assert engine.checkpoints.hits == 8 and engine.stats().prefix_cache_hits > 0
    assert_released(engine)


def test_same_tokens_without_checkpoints(chats):
    """Checkpoints off (0 slots): the hybrid reuses nothing (cached 0), and the tokens are the same."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, num_state_checkpoints=0)
    assert engine.checkpoints is None and not engine.block_manager.enable_prefix_caching
    results = run_turns(engine, turns, refs)
    assert all(r.cached_tokens == 0 for turn in results for r in turn)


def test_checkpoint_evicted_falls_back_to_an_older_one(chats):
    """Two checkpoint slots: turn 1 leaves 144 (its prompt's last boundary) and 160 (prompt + answer); a
    retry of the prompt touches 144, an unrelated request evicts 160: turn 2 resumes at 144, whose KV
    blocks and checkpoint both exist, with transformers' tokens."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, num_state_checkpoints=2)
    first = engine.generate([turns[0][0]], [greedy(ANSWER[0], logprobs=0)])[0]
    assert_matches(first, refs[0], 0)
    assert engine.checkpoints.num_registered == 2
    retry = engine.generate([turns[0][0]], [greedy(2)])[0]
    assert retry.token_ids == refs[0].token_ids[0][:2] and retry.cached_tokens == 144
    other = engine.generate([_random(torch.Generator().manual_seed(5), 40)], [greedy(1)])[0]
    assert other.cached_tokens == 0 and engine.checkpoints.evictions == 1
    second = engine.generate([turns[1][0]], [greedy(NEXT, logprobs=0)])[0]
    assert second.cached_tokens == 144
    assert_matches(second, refs[1], 0)
    assert_released(engine)


def test_kv_evicted_falls_back_to_the_longest_prefix_both_have(chats):
    """16 KV blocks: an unrelated request evicts the block of turn 1's tokens 144-160 (the tail goes
    first); the checkpoint at 160 remains but cannot be used without that block's KV: turn 2 resumes at 144."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, num_kv_blocks=16)
    first = engine.generate([turns[0][0]], [greedy(ANSWER[0])])[0]
    assert first.token_ids == refs[0].token_ids[0]
    other = engine.generate([_random(torch.Generator().manual_seed(6), 100)], [greedy(1)])[0]
    assert other.cached_tokens == 0
    probe = make_request("probe", 0, tokens=turns[1][0])
    ids, hashes = engine.block_manager.find_cached_chain(probe)
    assert len(ids) == 9  # blocks 0..8 (tokens 0-144) still cached, block 9 evicted
    assert engine.checkpoints.longest(probe, hashes)[0] == 9
    second = engine.generate([turns[1][0]], [greedy(NEXT, logprobs=0)])[0]
    assert second.cached_tokens == 144
    assert_matches(second, refs[1], 0)
    assert_released(engine)


def test_tiny_checkpoint_pool_under_pressure_keeps_answers_exact(chats):
    """Two checkpoint slots for four conversations at once: slots are evicted and often none is free
    (no save then); every turn still gives transformers' tokens; every pool consistent after every step."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, num_state_checkpoints=2)
    results = run_turns(engine, turns, refs, check_every_step=True)
    assert engine.checkpoints.evictions > 0 and engine.checkpoints.saves > 2
    assert all(r.cached_tokens % BS == 0 for turn in results for r in turn)
    assert_released(engine)


def test_kv_preemption_resumes_exactly(chats):
    """A KV cache too small for the four turn-2 prompts at once: requests are preempted mid-prefill and
    mid-decode (their checkpoint slots let go, maybe resumed from later), answers exact, pools consistent."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, num_kv_blocks=30, max_num_batched_tokens=64)
    run_turns(engine, turns[:1], refs[:1])
    got = stepwise(engine, turns[1], [NEXT] * 4)
    for i, r in enumerate(got):
        assert_matches(r, refs[1], i, f"conversation {i}")
    assert engine.stats().preemptions > 0
    assert_released(engine)


def test_abort_mid_prefill_of_a_resumed_request(chats):
    """Turn 2 resumed from its checkpoint and aborted mid-prefill (16-token steps): its state slot and
    checkpoint slot go back at once; sent again, it resumes from the checkpoint its one step left and
    matches transformers."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=16)
    engine.generate([turns[0][3]], [greedy(ANSWER[3])])
    engine.add_request("t2", prompt_token_ids=turns[1][3], params=greedy(NEXT))
    engine.step()
    req = engine.scheduler.requests["t2"]
    assert req.num_computed_tokens == expected_resume(FIRST[3], ANSWER[3]) + 16 < req.num_prompt_tokens
    assert engine.abort("t2") and req.state_slot is None and req.checkpoint_slot is None
    assert_released(engine)
    again = engine.generate([turns[1][3]], [greedy(NEXT, logprobs=0)])[0]
    # the aborted request's step ran: its checkpoint at 208 (turn 2's last prompt boundary) was kept
    assert again.cached_tokens == 208
    assert_matches(again, refs[1], 3)
    assert_released(engine)


def test_failed_step_drops_its_half_written_checkpoint(chats):
    """A step fails while saving at the second block boundary of turn 1's answer (176), after writing
    garbage into the slot that held the checkpoint at 160: that checkpoint is dropped, so turn 2 resumes
    at 144 (the prompt's) and still gives transformers' tokens."""
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS)
    store, calls = engine.runner.checkpoints, []
    save = store.save

    def failing(pairs):
        save(pairs)
        if pairs:
            calls.append(pairs)
        if len(calls) == 3 and pairs:  # 144 (the prompt), 160, then 176: the held slot of 160, overwritten
            for t in store.saved:
                t[:, pairs[0][1]] = float("nan")
            raise RuntimeError("injected failure during the checkpoint save")

    store.save = failing
    res = engine.generate([turns[0][0]], [greedy(40)])[0]
    assert res.finish_reason is FinishReason.ERROR and len(calls) == 3
    assert_released(engine)
    store.save = save
    prompt = turns[0][0] + refs[0].token_ids[0][:17] + [5, 6, 7]  # the answer up to 167: 160 would fit
    want = hf_reference(path, Case([prompt], [NEXT]))
    got = engine.generate([prompt], [greedy(NEXT, logprobs=0)])[0]
    assert got.cached_tokens == 144
    assert_matches(got, want, 0)
    assert_released(engine)


def test_budget_split_states_the_checkpoint_memory(chats, caplog):
    """From a memory budget: the state slots, then at most a tenth for checkpoints (never more than the
    KV blocks beside them), the KV blocks get the rest; the start-up line says so."""
    import logging

    path, _, _ = chats
    budget = 4 << 20
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        engine = make_engine(path, num_kv_blocks=None, kv_cache_memory=budget, block_size=BS, max_num_seqs=8)
    slot = 4 * 128 * 2 * 4  # conv layers x hidden x width x float32
    n = engine.checkpoints.num_slots
    assert n == (budget - 8 * slot) // 10 // slot and engine.checkpoint_bytes == n * slot
    block = 2 * 2 * BS * 2 * 32 * 4
    assert engine.block_manager.num_blocks == (budget - 8 * slot - n * slot) // block
    assert f"prefix reuse: {n} state checkpoints" in caplog.text


# ---- the scheduler and the index alone (no model) ------------------------------------------------------


def checkpoint_scheduler(slots: int = 4):
    sched = make_scheduler(block_size=4, max_tokens=64)
    sched.state = StatePool(8)
    sched.checkpoints = CheckpointIndex(slots, 4)
    return sched


def test_scheduler_cuts_the_prompt_at_its_last_boundary_and_saves_there():
    sched = checkpoint_scheduler()
    req = make_request("a", 10, max_tokens=6)
    sched.add(req)
    out = sched.schedule()
    [s] = out.scheduled
    assert (s.start, s.num_tokens, s.state_load) == (0, 8, None) and s.state_save is not None  # cut at 8
    sched.advance(out)
    assert sched.checkpoints.num_registered == 1 and req.checkpoint_slot is None  # a prompt's: let go
    saves = []
    while req.status.value != "finished":
        out = sched.schedule()
        saves += [(s.start + s.num_tokens, s.state_save) for s in out.scheduled if s.state_save is not None]
        sched.advance(out)
        for s in out.scheduled:
            if s.sample:
                req.output_token_ids.append(7)
                if req.num_output_tokens >= 6:
                    sched.finish(req, FinishReason.LENGTH)
    assert [end for end, _ in saves] == [12]  # the answer's boundary (tokens 0-15: computed 15)
    assert sched.checkpoints.num_registered == 2
    sched.checkpoints.check_integrity(sched.requests.values())
    again = make_request("b", 0, tokens=req.tokens(0, 14) + [9, 9], max_tokens=1)
    sched.add(again)
    out = sched.schedule()
    [s] = out.scheduled
    assert s.start == 12 and s.state_load == saves[0][1] and again.num_cached_tokens == 12


def test_scheduler_without_a_free_checkpoint_slot_saves_nothing():
    sched = checkpoint_scheduler(slots=1)
    a, b = make_request("a", 20, max_tokens=9), make_request("b", 20, max_tokens=9, tokens=list(range(200, 220)))
    sched.add(a)
    sched.add(b)
    for _ in range(5):  # the prompts (20: a boundary, one slot), then decodes up to 24 (one slot again)
        fake_step(sched)
    assert (a.checkpoint_slot is None) != (b.checkpoint_slot is None)  # one holds the only slot
    sched.checkpoints.check_integrity(sched.requests.values())
    sched.finish(a, FinishReason.ABORT)
    sched.finish(b, FinishReason.ERROR)
    sched.checkpoints.check_integrity(sched.requests.values())


def test_index_lru_eviction_order_and_integrity():
    idx = CheckpointIndex(2, 4)
    r1, r2, r3 = (make_request(f"r{i}", 8, tokens=[i] * 8) for i in range(1, 4))
    for r in (r1, r2):
        idx.take(r)
        idx.register(r, hash(r.request_id), tuple(r.tokens(0, 8)))
        idx.release(r)
    assert idx.longest(r1, [0, hash("r1")]) == (2, 0)  # r1 hit: r2's becomes the LRU's first
    assert idx.take(r3) == 1 and idx.evictions == 1 and idx.longest(r2, [0, hash("r2")]) == (0, None)
    assert idx.longest(r2, [0, hash("r1")]) == (0, None)  # same hash, other tokens: no hit
    with pytest.raises(RuntimeError, match="held"):
        idx.check_integrity([])  # r3 holds slot 1 but is not live
    idx.check_integrity([r3])
    idx.release(r3, keep=False)
    idx.check_integrity([])
    assert idx.num_registered == 1


def test_seat_preemption_mid_prefill_of_resumed_turns(chats):
    """Two seats, 16-token steps: batch-priority turn-2 requests resume from their checkpoints and are
    preempted mid-prefill by interactive ones (their checkpoint slots let go); every answer exact, every
    pool consistent after every step."""
    from engine.api import PreemptionCause

    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, max_num_seqs=2, max_num_batched_tokens=16)
    run_turns(engine, turns[:1], refs[:1])
    got: dict[str, list[int]] = {}
    mid_prefill = 0
    for i in (0, 2):
        engine.add_request(f"b{i}", prompt_token_ids=turns[1][i], params=greedy(NEXT), priority=2)
    engine.step()
    for i in (1, 3):
        engine.add_request(f"i{i}", prompt_token_ids=turns[1][i], params=greedy(NEXT), priority=0)
    while engine.has_unfinished():
        before = {r.request_id: r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running}
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        preempted = [rid for rid, prefilling in before.items() if prefilling
                     and engine.scheduler.requests.get(rid) is not None
                     and engine.scheduler.requests[rid].status.value == "waiting"]  # fmt: skip
        mid_prefill += len(preempted)
        engine.check_integrity()
    assert engine.stats().preemptions_by.get((2, PreemptionCause.SLOTS), 0) > 0 and mid_prefill > 0
    assert {rid: got[rid] for rid in got} == {f"b{i}" if i in (0, 2) else f"i{i}": refs[1].token_ids[i]
                                              for i in range(4)}  # fmt: skip
    assert_released(engine)
