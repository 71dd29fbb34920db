from engine.api import FinishReason
from engine.request import RequestStatus

from .factories import fake_step, make_request, make_scheduler


def test_decodes_and_prefill_chunks_share_the_token_budget():
    s = make_scheduler(max_tokens=16, prefix=False)
    s.add(make_request("a", 40, arrival=0))
    s.add(make_request("b", 5, arrival=1))
    assert fake_step(s) == {"a": 16}  # a's prompt chunked; budget spent
    assert fake_step(s) == {"a": 16}
    assert fake_step(s) == {"a": 8, "b": 5}  # a finishes its prompt; b fits in the rest
    assert fake_step(s) == {"a": 1, "b": 1}  # both decode


def test_waiting_order_is_priority_then_arrival():
    s = make_scheduler(max_num_seqs=1)
    s.add(make_request("late-important", 4, priority=0, arrival=5))
    s.add(make_request("early-batch", 4, priority=2, arrival=1))
    s.add(make_request("early-important", 4, priority=0, arrival=2))
    assert list(fake_step(s)) == ["early-important"]


def test_waiting_high_priority_preempts_at_max_num_seqs():
    s = make_scheduler(max_num_seqs=1)
    s.add(make_request("batch", 4, priority=2, arrival=0))
    fake_step(s)
    s.add(make_request("vip", 4, priority=0, arrival=1))
    assert list(fake_step(s)) == ["vip"]
    batch = s.requests["batch"]
    assert batch.status == RequestStatus.WAITING and batch.num_preemptions == 1
    assert s.num_preemptions == 1
    s.blocks.check_integrity(s.requests.values())


def test_equal_priority_does_not_preempt():
    s = make_scheduler(max_num_seqs=1)
    s.add(make_request("a", 4, priority=1, arrival=0))
    fake_step(s)
    s.add(make_request("b", 4, priority=1, arrival=1))
    assert list(fake_step(s)) == ["a"]
    assert s.num_preemptions == 0


def test_kv_shortage_preempts_least_important_most_recent():
    s = make_scheduler(num_blocks=6, block_size=4, max_tokens=64)
    s.add(make_request("old", 8, priority=1, arrival=0))
    s.add(make_request("new", 8, priority=1, arrival=1))
    s.add(make_request("vip", 4, priority=0, arrival=2))
    fake_step(s)  # 2 + 2 + 1 blocks used, 1 free
    for _ in range(3):
        fake_step(s)  # decodes grow; someone must give way
    assert s.requests["new"].num_preemptions >= 1
    assert s.requests["vip"].num_preemptions == 0
    assert s.requests["old"].num_preemptions == 0
    s.blocks.check_integrity(s.requests.values())


def test_preempted_request_keeps_its_place_and_tokens():
    s = make_scheduler(max_num_seqs=1, prefix=False)
    s.add(make_request("batch", 4, priority=2, arrival=0))
    fake_step(s)
    fake_step(s)
    s.add(make_request("vip", 4, priority=0, arrival=1, max_tokens=1))
    s.add(make_request("batch2", 4, priority=2, arrival=3))
    fake_step(s)  # vip preempts batch
    assert s.requests["batch"].output_token_ids == [7, 7]
    s.finish(s.requests["vip"], FinishReason.STOP)
    # batch (arrival 0) goes before batch2 (arrival 3) and recomputes prompt + its 2 tokens.
    assert fake_step(s) == {"batch": 6}


def test_finish_frees_blocks_in_any_state():
    s = make_scheduler(max_num_seqs=1)
    s.add(make_request("run", 6))
    s.add(make_request("wait", 6, arrival=1))
    fake_step(s)
    s.finish(s.requests["run"], FinishReason.ABORT)
    s.finish(s.requests["wait"], FinishReason.ABORT)
    assert s.blocks.num_used_blocks == 0 and not s.has_unfinished()
    s.blocks.check_integrity([])


def test_preempted_request_reuses_its_cached_prefix():
    s = make_scheduler(max_num_seqs=1, prefix=True)
    s.add(make_request("batch", 8, priority=2, arrival=0))
    fake_step(s)
    s.add(make_request("vip", 4, priority=0, arrival=1, max_tokens=1, tokens=[1, 2, 3, 4]))
    fake_step(s)  # vip preempts batch
    s.finish(s.requests["vip"], FinishReason.STOP)
    # batch's 8 prompt tokens (2 full blocks) were registered: only the sampled token is recomputed.
    assert fake_step(s) == {"batch": 1}
    assert s.requests["batch"].num_cached_tokens == 0  # cached_tokens reports the first schedule
