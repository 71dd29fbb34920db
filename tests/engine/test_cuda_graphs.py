"""Decode CUDA graphs without a GPU: bucket choice, padding, the eager-fallback decision, and the
graph runner itself with a capture that replays eagerly (Triton kernels under the interpreter)."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention import BatchLayout, TorchAttentionBackend  # noqa: E402
from engine.runner.cuda_graphs import (  # noqa: E402
    CONTEXT_LENS,
    IDS,
    POSITIONS,
    SLOTS,
    DecodeGraphRunner,
    decode_bucket,
    fill_decode_inputs,
    graph_buckets,
    graphs_enabled,
    pick_bucket,
)

from .helpers import greedy, make_engine  # noqa: E402


def decode_layout(contexts, tables, bs=4) -> BatchLayout:
    slots = [t[(c - 1) // bs] * bs + (c - 1) % bs for c, t in zip(contexts, tables, strict=True)]
    n = len(contexts)
    return BatchLayout(n, [1] * n, list(contexts), [list(t) for t in tables], bs, torch.tensor(slots))


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert graph_buckets(1) == (1,)
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_pick_bucket_takes_the_smallest_that_fits():
    b = graph_buckets(64)
    assert [pick_bucket(n, b) for n in (1, 2, 3, 5, 17, 33, 64)] == [1, 2, 4, 8, 32, 64, 64]
    assert pick_bucket(65, b) is None


def test_decode_bucket_falls_back_to_eager():
    b = graph_buckets(8)
    assert decode_bucket(decode_layout([5, 9, 2], [[3, 1], [0, 2, 7], [4]]), b, max_blocks=4) == 4
    # a prefill chunk in the step
    mixed = BatchLayout(1, [1, 3], [5, 3], [[3, 1], [2]], 4, torch.tensor([16, 8, 9, 10]))
    assert decode_bucket(mixed, b, max_blocks=4) is None
    # more sequences than the largest bucket
    many = decode_layout([1] * 9, [[i] for i in range(9)])
    assert decode_bucket(many, b, max_blocks=4) is None
    # a block table wider than the graph's buffers
    assert decode_bucket(decode_layout([17], [[0, 1, 2, 3, 4]]), b, max_blocks=4) is None
    assert decode_bucket(BatchLayout(0, [], [], [], 4, torch.zeros(0, dtype=torch.long)), b, 4) is None


class _GraphBackend(TorchAttentionBackend):
    supports_cuda_graphs = True


def test_graphs_only_on_cuda_when_enabled_and_supported():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_enabled(cuda, False, _GraphBackend())
    assert not graphs_enabled(cuda, True, _GraphBackend())  # enforce_eager
    assert not graphs_enabled(cuda, False, TorchAttentionBackend())  # backend without graph metadata
    assert not graphs_enabled(cpu, False, _GraphBackend())


def test_fill_decode_inputs_pads_to_the_bucket():
    vectors = torch.full((4, 8), 99, dtype=torch.long)  # stale values from an earlier, larger step
    tables = torch.full((8 * 6,), 99, dtype=torch.long)
    layout = decode_layout([5, 9, 2], [[3, 1], [0, 2, 7], [4]])
    w = fill_decode_inputs(vectors, tables, torch.tensor([11, 12, 13]), torch.tensor([4, 8, 1]), layout, 4)
    assert w == 3
    assert vectors[IDS, :4].tolist() == [11, 12, 13, 0]
    assert vectors[POSITIONS, :4].tolist() == [4, 8, 1, 0]
    assert vectors[SLOTS, :4].tolist() == layout.slot_mapping.tolist() + [-1]  # padding stores nothing
    assert vectors[CONTEXT_LENS, :4].tolist() == [5, 9, 2, 0]  # ... and reads nothing
    assert tables[:12].view(4, 3).tolist() == [[3, 1, 0], [0, 2, 7], [4, 0, 0], [0, 0, 0]]


# ---- the runner, replayed eagerly on the CPU -------------------------------------------------------


def _eager_capture(fn):
    return fn  # "replay" runs the forward again on the persistent buffers


@pytest.fixture(scope="module")
def triton_ready():
    pytest.importorskip("triton")
    from engine.attention import triton_kernels as K

    if not K.INTERPRETED:
        importlib.reload(K)
    return True


def test_reference_backend_has_no_graph_metadata():
    with pytest.raises(NotImplementedError, match="CUDA graphs"):
        TorchAttentionBackend().graph_decode_metadata(*(torch.zeros(1, dtype=torch.long),) * 3, 4, 16)


def test_graph_runner_matches_eager_decoding(build_model, triton_ready):
    """Decode steps through the graph runner (padded buckets, persistent buffers reused across
    steps of shrinking batches) give the reference backend's greedy tokens; prefills and batches
    over the largest bucket (4) ran eagerly."""
    path = build_model("tiny-llama")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 2000, (n,), generator=gen).tolist() for n in (5, 9, 2, 13, 7)]
    params = [greedy(m) for m in (7, 3, 9, 5, 4)]
    want = [r.token_ids for r in make_engine(path).generate(prompts, params)]

    engine = make_engine(path, attention_backend="triton", block_size=4, num_kv_blocks=64)
    runner = engine.runner
    graphs = DecodeGraphRunner(
        runner.model, runner.backend, runner.kv_caches, buckets=graph_buckets(4), block_size=4,
        max_model_len=engine.max_model_len, device=torch.device("cpu"), capture=_eager_capture,
    )
    graphs.capture_all()
    runner.graphs = graphs
    replayed, eager = [], []
    run, build = graphs.run, runner.backend.build_metadata

    def spy_run(bucket, ids, pos, layout):
        replayed.append((len(layout.query_lens), bucket))
        return run(bucket, ids, pos, layout)

    def spy_build(layout, device):  # only eager steps build metadata per step
        eager.append((layout.num_decodes, len(layout.query_lens)))
        return build(layout, device)

    graphs.run, runner.backend.build_metadata = spy_run, spy_build
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == want
    assert (3, 4) in replayed and (1, 1) in replayed  # 3 sequences padded to 4; a lone sequence
    assert (5, 5) in eager  # five decodes: over the largest bucket
    assert all(nd < n or n > 4 for nd, n in eager)  # nothing else ran eagerly but prefills
    engine.check_integrity()
