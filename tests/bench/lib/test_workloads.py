"""Benchmark workloads are deterministic for a seed and stay inside the requested lengths."""

from __future__ import annotations

import pytest

from bench.inproc.offline import serial_sample
from bench.lib.workloads import fixed_workload, mixed_workload, ordinary_token_ids

VOCAB = list(range(3, 500))


def test_fixed_workload_is_deterministic_and_exact():
    a = fixed_workload(VOCAB, num_requests=5, prompt_len=7, output_len=9, seed=3)
    assert a == fixed_workload(VOCAB, num_requests=5, prompt_len=7, output_len=9, seed=3)
    assert a.requests != fixed_workload(VOCAB, num_requests=5, prompt_len=7, output_len=9, seed=4).requests
    assert [len(r.prompt_token_ids) for r in a.requests] == [7] * 5
    assert [r.output_len for r in a.requests] == [9] * 5
    assert a.output_tokens == 45 and a.prompt_tokens == 35
    assert len({r.prompt_token_ids for r in a.requests}) == 5  # prompts differ: no accidental prefix sharing


def test_mixed_workload_is_deterministic_and_in_range():
    a = mixed_workload(VOCAB, num_requests=200, prompt_range=(16, 40), output_range=(2, 6), seed=1)
    assert a == mixed_workload(VOCAB, num_requests=200, prompt_range=(16, 40), output_range=(2, 6), seed=1)
    assert a.requests != mixed_workload(VOCAB, 200, (16, 40), (2, 6), seed=2).requests
    prompts = [len(r.prompt_token_ids) for r in a.requests]
    outputs = [r.output_len for r in a.requests]
    assert min(prompts) >= 16 and max(prompts) <= 40 and len(set(prompts)) > 10
    assert set(outputs) == {2, 3, 4, 5, 6}  # inclusive bounds, all reached over 200 draws
    assert all(t in set(VOCAB) for r in a.requests for t in r.prompt_token_ids)
    assert a.describe()["prompt_range"] == [16, 40]


@pytest.mark.parametrize(
    "kwargs",
    [{"num_requests": 0}, {"prompt_range": (0, 5)}, {"output_range": (9, 3)}, {"prompt_range": (1.5, 4)}],
)
def test_mixed_workload_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        mixed_workload(VOCAB, **kwargs)


def test_fixed_workload_rejects_bad_lengths():
    with pytest.raises(ValueError, match="output_len"):
        fixed_workload(VOCAB, output_len=0)


class _Token:
    def __init__(self, special: bool) -> None:
        self.special = special


class _FakeTokenizer:
    all_special_ids = [0, 2]
    added_tokens_decoder = {0: _Token(True), 1: _Token(True), 2: _Token(True), 7: _Token(False)}

    def get_vocab(self):
        return {f"t{i}": i for i in range(10)}

    def __len__(self):
        return 10


def test_ordinary_token_ids_drop_special_and_out_of_range_ids():
    assert ordinary_token_ids(_FakeTokenizer()) == [3, 4, 5, 6, 7, 8, 9]
    assert ordinary_token_ids(_FakeTokenizer(), vocab_size=6) == [3, 4, 5]


def test_serial_sample_matches_the_workload_means():
    w = mixed_workload(VOCAB, num_requests=32, prompt_range=(16, 512), output_range=(16, 256), seed=0)
    sample = serial_sample(w, 4)
    assert len(sample) == 4 and len(set(sample)) == 4 and sample == sorted(sample)
    assert sample == serial_sample(w, 4)  # deterministic
    mean_p = sum(len(w.requests[i].prompt_token_ids) for i in sample) / 4
    mean_o = sum(w.requests[i].output_len for i in sample) / 4
    assert mean_p == pytest.approx(w.prompt_tokens / 32, rel=0.03)
    assert mean_o == pytest.approx(w.output_tokens / 32, rel=0.03)
    assert serial_sample(w, 0) == list(range(32))
    assert serial_sample(w, 99) == list(range(32))


def test_other_cores_counts_only_other_processes():
    from bench.lib.machine import CpuSample, other_cores

    before = CpuSample(busy=100, total=1000, own=40)
    # 400 ticks passed on all CPUs; 300 busy of which 100 were ours -> 200 / 400 of the machine
    after = CpuSample(busy=400, total=1400, own=140)
    import os

    assert other_cores(before, after) == pytest.approx(0.5 * os.cpu_count())
    assert other_cores(before, None) is None
    assert other_cores(before, before) is None
