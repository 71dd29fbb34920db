"""The Triton attention kernels against float64 math and the reference backend, run on the CPU by
the Triton interpreter: block sizes, GQA ratios, head sizes that are not powers of two, contexts
across block boundaries, shuffled block tables, slot -1, split decode, poisoned outputs."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.attention import TorchAttentionBackend, select_backend  # noqa: E402
from engine.attention import triton_kernels as K  # noqa: E402

if not K.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
    K = importlib.reload(K)

from engine.attention.triton_backend import TritonAttentionBackend, TritonTiles  # noqa: E402

from .attention_cases import random_step, reference, rel_err  # noqa: E402
from .helpers import greedy, make_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TILES = TritonTiles(decode_n=16, prefill_m=16, prefill_n=16)  # small: the interpreter is slow
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref|| against float64


def test_kernels_run_under_the_interpreter():
    # The point of this module: these are interpreter functions, so the kernels below really run.
    assert K.INTERPRETED
    assert type(K._decode_kernel).__name__ == "InterpretedFunction"


# ---- store ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,kv_heads", [(1, 2), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_scatters_rows_and_skips_slot_minus_one(block_size, kv_heads, dtype):
    specs = [(7, 1), (block_size + 3, 1), (40, 40), (35, 9)]
    layout, s = random_step(specs, 4, kv_heads, 24, block_size, dtype, seed=block_size, skip=(0, 5, 30))
    k_cache, v_cache = s["k_cache"].clone(), s["v_cache"].clone()
    k, v = s["k"], s["v"]
    # v as a strided view, as the model's fused-QKV split hands it over
    v_wide = torch.cat([v, torch.zeros_like(v)], dim=1)[:, : v.shape[1]]
    K.store_kv(k, v_wide, k_cache, v_cache, layout.slot_mapping)
    slots = layout.slot_mapping
    keep = slots >= 0
    assert torch.equal(k_cache[:, slots[keep]], k[keep].transpose(0, 1))
    assert torch.equal(v_cache[:, slots[keep]], v[keep].transpose(0, 1))
    untouched = torch.ones(k_cache.shape[1], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(k_cache[:, untouched], s["k_cache"][:, untouched])  # -1 slots wrote nothing
    assert torch.equal(v_cache[:, untouched], s["v_cache"][:, untouched])


# ---- decode ---------------------------------------------------------------------------------------

DECODE_CASES = [
    # heads, kv_heads, head_dim, block_size, splits
    (4, 4, 32, 16, 1),  # no GQA
    (4, 2, 32, 1, 1),  # block size 1
    (6, 2, 24, 4, 3),  # group 3, head_dim 24 (padded tiles), 3 partitions
    (8, 1, 64, 16, 4),  # MQA
    (14, 2, 64, 16, 2),  # Qwen2.5-0.5B's heads (group 7)
    (4, 2, 32, 32, 8),  # more partitions than a short context has tiles: empty partitions
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,splits", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_reference(heads, kv_heads, head_dim, block_size, splits, dtype):
    bs = block_size
    ctxs = [1, max(1, bs - 1), bs, bs + 1, 3 * bs + 2, 77]  # across block boundaries
    specs = [(c, 1) for c in ctxs]
    layout, s = random_step(specs, heads, kv_heads, head_dim, bs, dtype, seed=heads * 100 + bs + splits)
    table, width = _padded_tables(layout.block_tables)
    out = torch.full_like(s["q"], float("nan"))  # poisoned: every row must be written
    scale = head_dim**-0.5
    K.paged_decode(s["q"], s["k_cache"], s["v_cache"], table, torch.tensor(ctxs), out, scale, bs, splits,
                   block_n=TILES.decode_n)
    want = reference(s["q"], s["k_cache"], s["v_cache"], layout, scale)
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_context_zero_writes_zeros(splits):
    # padded entries of a CUDA-graph batch: context 0 must give finite zeros beside real rows
    layout, s = random_step([(20, 1), (5, 1)], 4, 2, 32, 4, torch.float32, seed=splits)
    table, _ = _padded_tables(layout.block_tables + [[0]])
    q = torch.cat([s["q"], torch.randn(1, 4, 32)])
    out = torch.full_like(q, float("nan"))
    K.paged_decode(q, s["k_cache"], s["v_cache"], table, torch.tensor([20, 5, 0]), out, 0.2, 4, splits,
                   block_n=TILES.decode_n)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert rel_err(out[:2], reference(s["q"], s["k_cache"], s["v_cache"], layout, 0.2)) < 1e-5


def _padded_tables(tables):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), width


# ---- prefill --------------------------------------------------------------------------------------

PREFILL_CASES = [
    # heads, kv_heads, head_dim, block_size
    (4, 2, 32, 16),
    (6, 2, 24, 4),
    (8, 1, 64, 1),
    (14, 2, 64, 32),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_matches_reference(heads, kv_heads, head_dim, block_size, dtype):
    # two decodes first (the prefill kernel must leave their rows alone), then: a fresh prompt over
    # several query tiles, a chunk after a cached prefix, a chunk after earlier chunks, a 1-row chunk
    specs = [(9, 1), (30, 1), (37, 37), (52, 20), (70, 3)]
    layout, s = random_step(specs, heads, kv_heads, head_dim, block_size, dtype, seed=heads + block_size)
    backend = TritonAttentionBackend(num_sms=4, tiles=TILES)
    meta = backend.build_metadata(layout, torch.device("cpu"))
    out = torch.full_like(s["q"], float("nan"))
    scale = head_dim**-0.5
    K.paged_prefill(s["q"], s["k_cache"], s["v_cache"], out, meta.prefill_block_tables, meta.prefill_q_starts,
                    meta.prefill_q_lens, meta.prefill_context_lens, meta.tile_seqs, meta.tile_rows, scale,
                    block_size, TILES.prefill_m, TILES.prefill_n)
    nd = layout.num_decodes
    assert torch.isnan(out[:nd]).all()  # decode rows: not the prefill kernel's
    want = reference(s["q"], s["k_cache"], s["v_cache"], layout, scale)
    assert rel_err(out[nd:], want[nd:]) < TOL[dtype]


# ---- the backend -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 2])
def test_backend_forward_matches_torch_backend(dtype, splits):
    """A mixed step (decodes + prefill chunks, some slots -1) through both backends on the same
    cache: same stored K/V, same outputs."""
    specs = [(33, 1), (16, 1), (1, 1), (45, 45), (60, 12)]
    layout, s = random_step(specs, 6, 2, 32, 16, dtype, seed=7 if splits else 8, skip=(1, 20))
    scale = 32**-0.5
    cpu = torch.device("cpu")
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(num_sms=4, tiles=TILES, num_splits=splits)):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        outs.append(backend.forward(s["q"], s["k"], s["v"], kc, vc, backend.build_metadata(layout, cpu), scale))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert rel_err(outs[1], outs[0].double()) < TOL[dtype]


def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Everything the GPU would compile, compiled here: each kernel variant of a bf16 Qwen2.5-0.5B
    shape and of a float32 MQA shape, through Triton's compiler and the ptxas in its wheel, for
    sm_90. A fresh process without TRITON_INTERPRET (interpreted kernels do not compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    code = (
        "from engine.attention.triton_aot import main; "
        "main(['--arch', '90', '--dtype', 'bfloat16', '--heads', '14', '--kv-heads', '2', '--head-dim', '64']); "
        "main(['--arch', '90', '--dtype', 'float32', '--heads', '4', '--kv-heads', '1', '--head-dim', '32'])"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("sm_90")]
    assert len(lines) == 16 and all(" ok " in line for line in lines), run.stdout


def test_choose_num_splits():
    # many sequences fill the GPU without splitting; short contexts are never split
    assert K.choose_num_splits(256, 2, 4096, num_sms=132) == 1
    assert K.choose_num_splits(1, 2, 200, num_sms=132) == 1
    # one long sequence: split up to MAX_SPLITS, a power of two, >= MIN_PARTITION tokens each
    assert K.choose_num_splits(1, 2, 32768, num_sms=132) == K.MAX_SPLITS
    assert K.choose_num_splits(1, 2, 1024, num_sms=132) == 4
    assert K.choose_num_splits(8, 2, 32768, num_sms=132) == 16


def test_start_up_probe_kernel_runs_and_checks_what_it_wrote(monkeypatch):
    """triton_probe.kernel_reason, the launch half of the CUDA start-up check, on the interpreter."""
    from engine.attention import triton_probe

    cpu = torch.device("cpu")
    assert triton_probe.kernel_reason(cpu) is None
    monkeypatch.setattr(K, "store_kv", lambda *args: None)  # launches, writes nothing
    assert triton_probe.kernel_reason(cpu) == "a test kernel ran but wrote wrong values"

    def fails(*args):
        raise RuntimeError("PTXAS error:\n  line 2")

    monkeypatch.setattr(K, "store_kv", fails)
    assert triton_probe.kernel_reason(cpu) == "a test kernel failed to compile or run (RuntimeError: PTXAS error: line 2)"


def test_auto_selection_on_cpu_is_never_triton_even_under_the_interpreter():
    assert not isinstance(select_backend("cpu"), TritonAttentionBackend)
    assert isinstance(select_backend("cpu", "triton"), TritonAttentionBackend)


# ---- the engine on the Triton backend --------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt-oss"])  # GPT-OSS: sinks, a 24-token window
def test_engine_on_triton_backend_matches_torch_backend(build_model, preset):
    """Greedy tokens through the whole engine, Triton kernels against the reference backend:
    batched decodes, 8-token chunked prefill, prefix-cache hits, block size 4."""
    path = build_model(preset)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(10, 2000, (9,), generator=gen).tolist()
    prompts = [shared + torch.randint(10, 2000, (n,), generator=gen).tolist() for n in (3, 14, 1, 25)]
    prompts.append(torch.randint(10, 2000, (2,), generator=gen).tolist())
    params = [greedy(m) for m in (6, 3, 8, 4, 5)]
    results = []
    for backend in ("torch", "triton"):
        engine = make_engine(path, attention_backend=backend, block_size=4, num_kv_blocks=64,
                             max_num_batched_tokens=8, enable_prefix_caching=True)
        assert engine.runner.backend.name == backend
        results.append([r.token_ids for r in engine.generate(prompts, params)])
        assert engine.stats().prefix_cache_hits > 0
    assert results[0] == results[1]
