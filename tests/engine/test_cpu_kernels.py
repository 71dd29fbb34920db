"""The C++ CPU decode kernels (engine/kernels/csrc/cpu_attention.cpp, backend "cpu") against float64 math
and the reference backend: block sizes on and off the specialised paths, GQA groups in and past
the unrolled range, head sizes, slot -1, shuffled block tables, mixed decode + prefill steps."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, select_backend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels import cpu_kernels

from .attention_cases import random_step, reference, rel_err
from .helpers import greedy, make_engine, require_cpu_kernels

require_cpu_kernels()

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # ||out - ref|| / ||ref|| against float64

CASES = [
    # heads, kv_heads, head_dim, block_size
    (4, 4, 64, 32),  # no GQA, the specialised block and head sizes
    (9, 3, 64, 32),  # bench-135m's heads (group 3)
    (14, 2, 64, 16),  # Qwen2.5-0.5B's (group 7)
    (8, 1, 128, 16),  # MQA, group 8, head_dim 128
    (12, 1, 64, 32),  # group 12: past the unrolled groups
    (4, 2, 24, 5),  # head_dim 24 and block size 5: the generic loops
    (4, 2, 32, 1),  # block size 1
]


def _cpu_cache(k_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The reference layout's K cache rewritten with each block dimension-major (the cpu backend's)."""
    kvh, slots, d = k_cache.shape
    nb = slots // block_size
    return k_cache.view(kvh, nb, block_size, d).transpose(2, 3).contiguous().view(kvh, slots, d)


def test_kernels_are_built_and_chosen_on_cpu():
    assert all(cpu_kernels.load(g) is None and cpu_kernels.library_path(g).exists() for g in cpu_kernels.GROUPS)
    assert isinstance(select_backend("cpu"), CpuAttentionBackend)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_prefill_match_float64(heads, kv_heads, head_dim, block_size, dtype):
    # Decodes whose contexts end inside, at and just past a block; then a fresh prefill and a chunk
    # over cached context; one new token's slot is -1 (must not be stored).
    specs = [(1, 1), (block_size, 1), (block_size + 1, 1), (3 * block_size + 2, 1), (37, 1), (20, 20), (45, 9)]
    layout, s = random_step(specs, heads, kv_heads, head_dim, block_size, dtype, seed=heads + block_size, skip=(3,))
    scale = head_dim**-0.5
    backend = CpuAttentionBackend()
    meta = backend.build_metadata(layout, torch.device("cpu"))
    k_cache, v_cache = _cpu_cache(s["k_cache"], block_size), s["v_cache"].clone()
    out = backend.forward(s["q"], s["k"], s["v"], k_cache, v_cache, meta, scale)

    # What the reference layout holds after the same store, for the float64 answer.
    ref_k, ref_v = s["k_cache"].clone(), s["v_cache"].clone()
    TorchAttentionBackend()._store(s["k"], s["v"], ref_k, ref_v, meta)
    assert torch.equal(k_cache, _cpu_cache(ref_k, block_size))  # K stored dimension-major, -1 skipped
    assert torch.equal(v_cache, ref_v)
    want = reference(s["q"], ref_k, ref_v, layout, scale)
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_step_matches_the_reference_backend(dtype):
    specs = [(n, 1) for n in (5, 31, 32, 33, 64, 100, 257)]
    layout, s = random_step(specs, 9, 3, 64, 32, dtype, seed=7)
    ref, cpu = TorchAttentionBackend(), CpuAttentionBackend()
    k_ref, v_ref = s["k_cache"].clone(), s["v_cache"].clone()
    k_cpu, v_cpu = _cpu_cache(s["k_cache"], 32), s["v_cache"].clone()
    want = ref.forward(s["q"], s["k"], s["v"], k_ref, v_ref, ref.build_metadata(layout, torch.device("cpu")), 0.125)
    # q as the model hands it over: a strided view into the fused QKV output
    q = torch.cat([s["q"], torch.full_like(s["q"], float("nan"))], dim=1)[:, : s["q"].shape[1]]
    got = cpu.forward(q, s["k"], s["v"], k_cpu, v_cpu, cpu.build_metadata(layout, torch.device("cpu")), 0.125)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_on_shuffled_blocks_matches_float64(heads, kv_heads, head_dim, block_size, dtype):
    # The op alone, on the cpu layout: contexts ending inside, at and past a block, shuffled block
    # tables, and a sequence with no context (zeros).
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    lens = [1, block_size, block_size + 1, 3 * block_size + 2, 37, 0]
    width = (max(lens) + block_size - 1) // block_size
    blocks = torch.randperm(len(lens) * width + 3, generator=g)[: len(lens) * width].view(len(lens), width)
    slots = (len(lens) * width + 3) * block_size
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)  # used as [kvh, blocks, D, bs]
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    got = torch.ops.tokenmill.paged_decode_attention(q, k_cache, v_cache, blocks, torch.tensor(lens), block_size,
                                                     max(lens), scale)  # fmt: skip
    assert got.dtype == dtype and got.shape == (len(lens), heads, head_dim)
    k_tok = k_cache.double().view(kv_heads, -1, head_dim, block_size).transpose(2, 3)  # [kvh, blocks, bs, D]
    v_tok = v_cache.double().view(kv_heads, -1, block_size, head_dim)
    for s, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[s], torch.zeros_like(got[s]))
            continue
        k = k_tok[:, blocks[s]].reshape(kv_heads, -1, head_dim)[:, :n].repeat_interleave(heads // kv_heads, 0)
        v = v_tok[:, blocks[s]].reshape(kv_heads, -1, head_dim)[:, :n].repeat_interleave(heads // kv_heads, 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[s].double(), k) * scale, -1)
        assert rel_err(got[s], torch.einsum("ht,htd->hd", p, v)) < TOL[dtype], s


def test_kernels_reject_bad_input():
    q = torch.randn(2, 4, 32)
    cache = torch.randn(2, 64, 32)
    tables, lens = torch.zeros(2, 2, dtype=torch.long), torch.tensor([3, 5])
    attention = torch.ops.tokenmill.paged_decode_attention
    with pytest.raises(RuntimeError, match="dtype"):
        attention(q.to(torch.bfloat16), cache, cache, tables, lens, 32, 64, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        attention(q, cache, cache, tables.int(), lens, 32, 64, 1.0)
    with pytest.raises(RuntimeError, match="block_size"):
        attention(q, cache, cache, tables, lens, 7, 64, 1.0)
    with pytest.raises(RuntimeError, match="must match"):
        attention(q, cache, cache[:, :32].contiguous(), tables, lens, 32, 64, 1.0)


def test_a_table_or_slot_outside_the_cache_is_an_error_not_a_stray_read():
    """A bad block table or slot mapping (a bug upstream) fails the call naming the entry; the kernels
    read and write the cache unchecked otherwise (a segmentation fault, or another sequence's KV)."""
    q = torch.randn(2, 4, 32)
    cache = torch.randn(2, 64, 32)  # 2 blocks of 32
    attention = torch.ops.tokenmill.paged_decode_attention
    lens = torch.tensor([3, 40])
    ok = torch.tensor([[1, 0], [0, 1]])
    attention(q, cache, cache, ok, lens, 32, 64, 1.0)
    for bad in (2, -1, 1 << 40):
        tables = ok.clone()
        tables[1, 1] = bad  # in use: 40 tokens span two blocks
        with pytest.raises(RuntimeError, match=f"entry 1 of sequence 1 is {bad}, not a block"):
            attention(q, cache, cache, tables, lens, 32, 64, 1.0)
    unused = ok.clone()
    unused[0, 1] = 99  # past sequence 0's 3 tokens: never read
    attention(q, cache, cache, unused, lens, 32, 64, 1.0)
    with pytest.raises(RuntimeError, match="65 tokens of context but a table of 2 blocks"):
        attention(q, cache, cache, ok, torch.tensor([3, 65]), 32, 128, 1.0)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        attention(q, cache, cache, ok, torch.tensor([3, 0, 40, 0])[::2], 32, 64, 1.0)
    kv = torch.randn(2, 2, 32)
    store = torch.ops.tokenmill.paged_store_kv
    store(kv, kv, cache, cache.clone(), torch.tensor([63, -1]), 32)
    with pytest.raises(RuntimeError, match="slot 64 of row 1 is outside the cache"):
        store(kv, kv, cache, cache.clone(), torch.tensor([0, 64]), 32)


@pytest.mark.parametrize("block_size,num_blocks", [(4, 160), (32, 32)])
def test_engine_on_cpu_kernels_matches_torch_backend(build_model, block_size, num_blocks):
    """Greedy tokens through the whole engine (float32), C++ kernels against the reference:
    batched decodes, 8-token chunked prefill, prefix-cache hits, the generic (4) and the
    specialised (32) block loops."""
    path = build_model("tiny-llama")
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(10, 2000, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(10, 2000, (n,), generator=gen).tolist() for n in (3, 14, 1, 25, 40)]
    prompts.append(torch.randint(10, 2000, (2,), generator=gen).tolist())
    params = [greedy(m) for m in (6, 3, 8, 4, 20, 5)]
    results = []
    for backend in ("torch", "cpu"):
        engine = make_engine(path, attention_backend=backend, block_size=block_size, num_kv_blocks=num_blocks,
                             max_num_batched_tokens=8, enable_prefix_caching=True)
        assert engine.runner.backend.name == backend
        results.append([r.token_ids for r in engine.generate(prompts, params)])
        assert engine.stats().prefix_cache_hits > 0
    assert results[0] == results[1]
