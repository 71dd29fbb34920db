"""Learned attention sinks (GPT-OSS; engine/attention/base.py's `sinks`): the reference backend and the C++
CPU decode kernel against the dense float64 answer with each head's sink logit in the softmax, on mixed
steps (decodes, a fresh prompt, chunks over cached context), with and without a sliding window; the
Triton backend, which has no sinks yet, is refused at start-up (engine/attention for_sinks), never run."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, for_sinks
from engine.attention.cpu_backend import CpuAttentionBackend

from .attention_cases import random_step, reference, rel_err
from .helpers import require_cpu_kernels

require_cpu_kernels()

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
# decodes (context, 1) first, then prefill chunks (context, query)
SPECS = [(1, 1), (7, 1), (16, 1), (17, 1), (41, 1), (70, 1), (37, 37), (52, 20), (70, 3), (12, 12)]
HEADS, KV_HEADS, DIM = 6, 2, 32


def _cpu_cache(k_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    kvh, slots, d = k_cache.shape
    return k_cache.view(kvh, slots // block_size, block_size, d).transpose(2, 3).contiguous().view(kvh, slots, d)


def _run(backend, layout, s, bs, scale, window, sinks):
    kc = _cpu_cache(s["k_cache"], bs) if backend.name == "cpu" else s["k_cache"].clone()
    meta = backend.build_metadata(layout, torch.device("cpu"))
    return backend.forward(s["q"], s["k"], s["v"], kc, s["v_cache"].clone(), meta, scale, window, None, sinks)


def _want(layout, s, scale, window, sinks):
    k_cache, v_cache = s["k_cache"].clone(), s["v_cache"].clone()
    keep = layout.slot_mapping >= 0
    k_cache[:, layout.slot_mapping[keep]] = s["k"][keep].transpose(0, 1)
    v_cache[:, layout.slot_mapping[keep]] = s["v"][keep].transpose(0, 1)
    return reference(s["q"], k_cache, v_cache, layout, scale, window, None, sinks)


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_match_the_dense_reference(backend, window, dtype):
    bs = 16
    layout, s = random_step(SPECS, HEADS, KV_HEADS, DIM, bs, dtype, seed=7 + (window or 0), skip=(2,))
    # sinks from far below to far above the scores: heads where the sink takes most of the weight
    sinks = torch.tensor([-4.0, -0.5, 0.0, 0.7, 2.0, 5.0]).to(dtype)
    scale = DIM**-0.5
    out = _run(backend(), layout, s, bs, scale, window, sinks)
    want = _want(layout, s, scale, window, sinks)
    assert rel_err(out, want) < TOL[dtype]
    # the sinks matter here: without them the answer differs
    assert rel_err(out, _want(layout, s, scale, window, None)) > 10 * TOL[dtype]


def test_decode_kernel_checks_the_sinks_shape():
    bs = 16
    layout, s = random_step([(9, 1)], HEADS, KV_HEADS, DIM, bs, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="sinks must be"):
        _run(CpuAttentionBackend(), layout, s, bs, 1.0, None, torch.zeros(HEADS + 1))


class _NoSinks(TorchAttentionBackend):
    name = "nosinks"
    sinks_unsupported = "no sinks in this backend"


def test_backends_without_sinks_are_refused_or_replaced(monkeypatch, caplog):
    assert for_sinks(backend := TorchAttentionBackend(), "auto") is backend
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "0")
    with caplog.at_level("WARNING", logger="tokenmill.engine"):
        got = for_sinks(_NoSinks(), "auto")
    assert got.name == "torch" and any("no sinks in this backend" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="attention_backend 'triton': no sinks in this backend"):
        for_sinks(_NoSinks(), "triton")
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "1")  # no silent fallback
    with pytest.raises(ValueError, match="TOKENMILL_REQUIRE_KERNELS=1: no sinks in this backend"):
        for_sinks(_NoSinks(), "auto")


def test_triton_backend_declares_no_sinks():
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    assert TritonAttentionBackend.sinks_unsupported is not None
