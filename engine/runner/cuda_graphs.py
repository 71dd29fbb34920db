"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on persistent buffers.

A decode-only step of n sequences runs the graph of the smallest bucket >= n (1, 2, 4, ... up to
max_num_seqs). Its inputs are padded to the bucket, written into pinned host buffers and copied to
the persistent device buffers the graphs were captured on; padded entries have slot -1 (nothing is
stored) and context length 0 (nothing is read). The hidden states of the first n rows are the
result. Steps with a prefill chunk, and batches over the largest bucket, run eagerly.

The bucket and padding logic is plain tensor code that the CPU tests run; only CudaGraphCapture
touches CUDA, and only when called.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.models.layers import ForwardContext

log = logging.getLogger("tokenmill.engine")

WARMUP_RUNS = 2  # eager runs before a capture: Triton JIT, cuBLAS handles and lazy init stay outside

# rows of the persistent [4, max_bucket] int64 input buffer
IDS, POSITIONS, SLOTS, CONTEXT_LENS = range(4)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: powers of two below max_num_seqs, then max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return (*sizes, max_num_seqs)


def pick_bucket(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds num_seqs sequences; None when none does."""
    return next((b for b in buckets if b >= num_seqs), None)


def graphs_enabled(device: torch.device, enforce_eager: bool, backend: AttentionBackend) -> bool:
    """Whether decode steps run in CUDA graphs: on CUDA, unless turned off, with a backend that can."""
    return device.type == "cuda" and not enforce_eager and backend.supports_cuda_graphs


def decode_bucket(layout: BatchLayout, buckets: tuple[int, ...], max_blocks: int) -> int | None:
    """The bucket whose graph runs this step, or None for an eager step: a prefill chunk in it, more
    sequences than the largest bucket, or a block table wider than the graph's buffers."""
    n = len(layout.query_lens)
    if n == 0 or layout.num_decodes != n:
        return None
    if max(len(t) for t in layout.block_tables) > max_blocks:
        return None
    return pick_bucket(n, buckets)


def fill_decode_inputs(
    vectors: torch.Tensor, tables: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
    layout: BatchLayout, bucket: int,
) -> int:
    """Write a decode step padded to `bucket` into host buffers; returns the block-table width w.

    vectors: [4, >= bucket] int64; columns :bucket get input ids (padding 0), positions (0), slots
    (-1) and context lengths (0). tables: flat int64; its first bucket * w entries get the block
    tables as zero-padded rows of width w."""
    n = len(layout.query_lens)
    vectors[:, :bucket] = 0
    vectors[SLOTS, :bucket] = -1
    vectors[IDS, :n] = input_ids
    vectors[POSITIONS, :n] = positions
    vectors[SLOTS, :n] = layout.slot_mapping
    vectors[CONTEXT_LENS, :n] = torch.tensor(layout.context_lens, dtype=torch.long)
    width = max(len(t) for t in layout.block_tables)
    rows: list[int] = []
    for t in layout.block_tables:
        rows.extend(t)
        rows.extend([0] * (width - len(t)))
    rows.extend([0] * ((bucket - n) * width))
    tables[: bucket * width] = torch.tensor(rows, dtype=torch.long)
    return width


class CudaGraphCapture:
    """Captures callables into CUDA graphs that share one memory pool (capture the largest first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None
        self.graphs: list = []  # torch.cuda.CUDAGraph; kept alive for their replays

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm fn up on a side stream, capture it, and return a replay that returns its output
        tensor (rewritten in place by each replay)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphRunner:
    """The model's decode forward, captured once per bucket on persistent input buffers.

    capture turns a zero-argument forward into a replay callable: CudaGraphCapture on CUDA; the CPU
    tests pass one that returns the forward itself, so the buffers and padding run for real there.
    """

    def __init__(
        self, model, backend: AttentionBackend, kv_caches, *, buckets: tuple[int, ...], block_size: int,
        max_model_len: int, device: torch.device, capture: Callable | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buckets = buckets
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.capture = capture if capture is not None else CudaGraphCapture(device)
        pin = device.type == "cuda"
        width = buckets[-1]
        # host side, pinned: one step's inputs before their copy
        self.host_vectors = torch.zeros((4, width), dtype=torch.long, pin_memory=pin)
        self.host_tables = torch.zeros(width * self.max_blocks, dtype=torch.long, pin_memory=pin)
        # device side: what the graphs read ([4, B] vectors, [B, max_blocks] tables) ...
        self.vectors = torch.zeros((4, width), dtype=torch.long, device=device)
        self.vectors[SLOTS].fill_(-1)
        self.tables = torch.zeros((width, self.max_blocks), dtype=torch.long, device=device)
        # ... and where the step's [B, w] tables land before they are spread into `tables`
        self.staged_tables = torch.zeros(width * self.max_blocks, dtype=torch.long, device=device)
        self._copied = None  # CUDA event after the last host-to-device copy
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool."""
        t0 = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            self._replays[b] = self.capture(self._forward_fn(b))
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    def _forward_fn(self, b: int) -> Callable[[], torch.Tensor]:
        v = self.vectors
        meta = self.backend.graph_decode_metadata(
            v[SLOTS, :b], self.tables[:b], v[CONTEXT_LENS, :b], self.block_size, self.max_model_len
        )
        ctx = ForwardContext(self.backend, meta, self.kv_caches)
        ids, positions = v[IDS, :b], v[POSITIONS, :b]
        return lambda: self.model(ids, positions, ctx)

    def bucket_for(self, layout: BatchLayout) -> int | None:
        """The captured bucket for this step, or None: run it eagerly."""
        b = decode_bucket(layout, self.buckets, self.max_blocks)
        return b if b in self._replays else None

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay a bucket's graph on whatever its buffers hold now (benchmarks time this)."""
        return self._replays[bucket]()

    def run(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Replay the bucket's graph on this step's inputs (host tensors). Returns hidden [n, hidden],
        valid until the next replay."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffers
        w = fill_decode_inputs(self.host_vectors, self.host_tables, input_ids, positions, layout, bucket)
        nb = self.device.type == "cuda"
        self.vectors.copy_(self.host_vectors, non_blocking=nb)
        staged = self.staged_tables[: bucket * w]
        staged.copy_(self.host_tables[: bucket * w], non_blocking=nb)
        self.tables[:bucket, :w].copy_(staged.view(bucket, w))
        if nb:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._replays[bucket]()[: len(layout.query_lens)]


def capture_graphs(model, backend, kv, buckets: list[int], block_size: int, max_model_len: int,
                   device: torch.device) -> DecodeGraphRunner:
    """Capture the decode graphs of every bucket; logs the memory they took."""
    before = torch.cuda.memory_reserved(device)
    graphs = DecodeGraphRunner(model, backend, kv, buckets=buckets, block_size=block_size,
                               max_model_len=max_model_len, device=device)
    with torch.inference_mode():
        graphs.capture_all()
    torch.cuda.synchronize(device)
    log.info("decode graphs hold %.0f MiB", (torch.cuda.memory_reserved(device) - before) / 2**20)
    return graphs
