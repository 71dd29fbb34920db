"""Sliding-window attention and attention-logit soft-capping (engine/attention/base.py's `window` and
`softcap`) in every backend against the dense masked float64 answer: the reference, the C++ CPU kernels
and the Triton kernels (under the Triton interpreter), on mixed steps (decodes whose window starts
inside, at and before a block boundary, a fresh prompt longer than the window, chunks over cached
context), and the kernels never reading a block that left the window."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention import TorchAttentionBackend  # noqa: E402
from engine.attention.cpu_backend import CpuAttentionBackend  # noqa: E402

from .attention_cases import random_step, reference, rel_err  # noqa: E402
from .helpers import require_cpu_kernels  # noqa: E402

require_cpu_kernels()

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref|| against float64
# decodes (context, 1) first, then prefill chunks (context, query): contexts far past the window
SPECS = [(1, 1), (7, 1), (16, 1), (17, 1), (41, 1), (70, 1), (37, 37), (52, 20), (70, 3), (12, 12)]
# (window, softcap): a window shorter than a block, one across blocks, the cap alone, both
KNOBS = [(5, None), (13, None), (None, 7.5), (9, 3.0)]


def _triton_backend(splits):
    pytest.importorskip("triton")
    from engine.attention import triton_kernels as K

    if not K.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
        importlib.reload(K)
    from engine.attention import triton_backend

    importlib.reload(triton_backend)
    tiles = triton_backend.TritonTiles(decode_n=16, prefill_m=16, prefill_n=16)  # small: the interpreter is slow
    return triton_backend.TritonAttentionBackend(num_sms=4, tiles=tiles, num_splits=splits)


def _cpu_cache(k_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The reference layout's K cache with each block dimension-major (the cpu backend's)."""
    kvh, slots, d = k_cache.shape
    return k_cache.view(kvh, slots // block_size, block_size, d).transpose(2, 3).contiguous().view(kvh, slots, d)


def _run(backend, layout, s, block_size, scale, window, softcap):
    kc = _cpu_cache(s["k_cache"], block_size) if backend.name == "cpu" else s["k_cache"].clone()
    meta = backend.build_metadata(layout, torch.device("cpu"))
    return backend.forward(s["q"], s["k"], s["v"], kc, s["v_cache"].clone(), meta, scale, window, softcap)


def _want(layout, s, scale, window, softcap):
    k_cache, v_cache = s["k_cache"].clone(), s["v_cache"].clone()
    keep = layout.slot_mapping >= 0
    k_cache[:, layout.slot_mapping[keep]] = s["k"][keep].transpose(0, 1)
    v_cache[:, layout.slot_mapping[keep]] = s["v"][keep].transpose(0, 1)
    return reference(s["q"], k_cache, v_cache, layout, scale, window, softcap)


BACKENDS = ["torch", "cpu", "triton", "triton-split"]


def _backend(name):
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    return _triton_backend(2 if name == "triton-split" else None)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("window,softcap", KNOBS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_and_softcap_match_the_dense_masked_reference(backend_name, window, softcap, dtype):
    bs = 8 if backend_name != "cpu" else 16  # the cpu kernels' specialised block size, and another
    layout, s = random_step(SPECS, 6, 2, 32, bs, dtype, seed=(window or 0) + bs, skip=(2,))
    scale = 32**-0.5
    out = _run(_backend(backend_name), layout, s, bs, scale, window, softcap)
    want = _want(layout, s, scale, window, softcap)
    assert rel_err(out, want) < TOL[dtype]
    if window is not None:  # the window matters here: full attention gives another answer
        assert rel_err(out, _want(layout, s, scale, None, softcap)) > 10 * TOL[dtype]


@pytest.mark.parametrize("backend_name", ["cpu", "triton", "triton-split"])
def test_blocks_before_the_window_are_never_read(backend_name):
    """Every block wholly before each sequence's earliest window start is NaN in the cache (as a
    freed block's placeholder might hold anything): the kernels must not read it."""
    bs, window = 8, 11
    layout, s = random_step(SPECS, 4, 2, 32, bs, torch.float32, seed=3)
    scale = 32**-0.5
    want = _want(layout, s, scale, window, None)
    for table, ctx, ql in zip(layout.block_tables, layout.context_lens, layout.query_lens, strict=True):
        first_seen = max(0, ctx - ql - window + 1)
        for b in table[: first_seen // bs]:
            s["k_cache"][:, b * bs : (b + 1) * bs] = float("nan")
            s["v_cache"][:, b * bs : (b + 1) * bs] = float("nan")
    out = _run(_backend(backend_name), layout, s, bs, scale, window, None)
    assert rel_err(out, want) < TOL[torch.float32]
