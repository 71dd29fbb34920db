"""Learned attention sinks (GPT-OSS; engine/attention/base.py's `sinks`): the reference backend, the C++
CPU decode kernel and the Triton kernels (under the Triton interpreter; decode whole and split, so the
merge kernel adds the sink) against the dense float64 answer with each head's sink logit in the softmax,
on mixed steps (decodes, a fresh prompt, chunks over cached context), with and without a sliding window;
a backend without sinks is refused at start-up or replaced by the reference (engine/attention for_sinks)."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention import TorchAttentionBackend, for_sinks  # noqa: E402
from engine.attention.cpu_backend import CpuAttentionBackend  # noqa: E402

from .attention_cases import random_step, reference, rel_err  # noqa: E402
from .helpers import require_cpu_kernels  # noqa: E402

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


def _triton(splits):
    pytest.importorskip("triton")
    from engine.attention import triton_kernels as K

    if not K.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
        importlib.reload(K)  # in place: triton_backend's K is this module object
    from engine.attention import triton_backend

    tiles = triton_backend.TritonTiles(decode_n=16, prefill_m=16, prefill_n=16)  # small: the interpreter is slow
    return triton_backend.TritonAttentionBackend(num_sms=4, tiles=tiles, num_splits=splits)


BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend, "triton": lambda: _triton(None),
            "triton-split": lambda: _triton(2)}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_match_the_dense_reference(backend, window, dtype):
    bs = 16
    layout, s = random_step(SPECS, HEADS, KV_HEADS, DIM, bs, dtype, seed=7 + (window or 0), skip=(2,))
    # sinks from far below to far above the scores: heads where the sink takes most of the weight
    sinks = torch.tensor([-4.0, -0.5, 0.0, 0.7, 2.0, 5.0]).to(dtype)
    scale = DIM**-0.5
    out = _run(BACKENDS[backend](), layout, s, bs, scale, window, sinks)
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


def test_every_backend_takes_sinks():
    assert all(BACKENDS[name]().sinks_unsupported is None for name in ("torch", "cpu", "triton"))
