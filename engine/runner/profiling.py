"""How much device memory a step's activations take, measured on the device at start-up (CUDA), so the
KV cache gets the rest: one forward at the largest step, and a decode forward at the largest graph
bucket when decode graphs will be captured (their memory pool stays allocated)."""

from __future__ import annotations

import logging

import torch

from engine.attention import BatchLayout
from engine.kv.cache import KVCacheSpec, allocate_kv_cache
from engine.models.layers import ForwardContext

log = logging.getLogger("tokenmill.engine")


def activation_peak_bytes(model, backend, spec: KVCacheSpec, device: torch.device, tokens: int, logits_rows: int,
                          graph_batch: int = 0) -> int:
    """Bytes to keep free besides the weights, measured, not guessed: the activation peak of one forward
    of `tokens` prompt tokens (the step's budget, at most the context) with `logits_rows` logits rows
    (max_num_seqs), plus, when decode graphs will be captured (graph_batch > 0), that of a decode forward
    at the largest bucket."""
    bs = spec.block_size
    blocks = -(-tokens // bs)
    prefill = BatchLayout(0, [tokens], [tokens], [list(range(blocks))], bs, torch.arange(tokens))
    peak = _peak_bytes(model, backend, spec, device, prefill, blocks, logits_rows)
    if graph_batch:  # one context token each, read from block 0; slot -1 stores nothing
        decode = BatchLayout(graph_batch, [1] * graph_batch, [1] * graph_batch, [[0]] * graph_batch, bs,
                             torch.full((graph_batch,), -1, dtype=torch.long))
        graph_peak = _peak_bytes(model, backend, spec, device, decode, blocks, logits_rows=0)
        log.info("profiled activations: step peak %.0f MiB, decode graphs ~%.0f MiB", peak / 2**20, graph_peak / 2**20)
        peak += graph_peak
    return peak


def _peak_bytes(model, backend, spec: KVCacheSpec, device: torch.device, layout: BatchLayout, blocks: int,
                logits_rows: int) -> int:
    n = len(layout.slot_mapping)
    kv = allocate_kv_cache(spec, blocks, device, backend)
    pos = [p for c, q in zip(layout.context_lens, layout.query_lens, strict=True) for p in range(c - q, c)]
    positions = torch.tensor(pos, dtype=torch.long, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        ids = torch.zeros(n, dtype=torch.long, device=device)
        ctx = ForwardContext(backend, backend.build_metadata(layout, device), kv)
        hidden = model(ids, positions, ctx)
        if logits_rows:
            model.compute_logits(hidden[-logits_rows:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, ctx, hidden
    torch.cuda.empty_cache()
    return int(peak)
