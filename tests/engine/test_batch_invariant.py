"""Batch-invariant mode (EngineConfig.deterministic, engine/models/batch_invariant.py).

One prompt set (chat and completion prompts, greedy and seeded, some sharing a prefix) is run one
request at a time as the reference, then in batches of 2, 8 and 32 with shuffled neighbours, with
prefix-cache hits, with step budgets (prefill chunks) of 16, 64 and 512 tokens, under forced
preemption, and with speculative decoding: every run must be token-identical to the reference, in
bf16 and float32. The kernels it rests on are checked row by row too. Outside the mode the same bf16
runs differ on this machine (the last test), which is what the mode is for.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, SamplingParams
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.config.speculative import SpeculativeConfig
from engine.models.packed_linear import packing_supported

from .helpers import make_engine, require_cpu_kernels

require_cpu_kernels()

ops = torch.ops.tokenmill
BF16 = ops.gemv_supported("bf16")
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU lacks AVX2/FMA (the mode refuses bf16 weights there)")
# oneDNN packs bf16 where the CPU has AVX-512 BW/VL/DQ: the mode's TiledLinear is oneDNN's; without it
# (an AVX2-only CPU) the mode runs the kernel at every row count (test_without_onednn_...)
ONEDNN = packing_supported(torch.device("cpu"), torch.bfloat16)
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="oneDNN does not pack bf16 on this CPU (AVX2 only)")
DTYPES = [pytest.param("bfloat16", marks=needs_bf16), "float32"]
N_PROMPTS = 20
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(build_model):
    return build_model("tiny-llama")


def _prompt_set(engine: Engine) -> tuple[list[list[int]], list[SamplingParams]]:
    """20 prompts: even ones chat (via the template), odd ones raw completion tokens; 0..7 share a
    40-token prefix; every third is sampled with its own seed (every sixth also with top-p)."""
    rng = random.Random(26)
    vocab = engine.vocab_size
    shared = [rng.randrange(10, vocab) for _ in range(40)]
    prompts, params = [], []
    for i in range(N_PROMPTS):
        if i % 2 == 0:
            text = " ".join(rng.choice(["tell", "me", "about", "the", "sea", "a", "cat", "why", "code"])
                            for _ in range(rng.randrange(3, 30)))  # fmt: skip
            ids = engine.apply_chat_template([{"role": "user", "content": text}])
        else:
            ids = [rng.randrange(10, vocab) for _ in range(rng.randrange(1, 90))]
        prompts.append((shared + ids) if i < 8 else ids)
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=1000 + i,
                                         top_p=0.9 if i % 6 == 0 else 1.0))  # fmt: skip
        else:
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return prompts, params


def _neighbours(vocab: int, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(1, 60))] for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0) for _ in range(n)]


def _alone(engine: Engine, prompts, params) -> list[list[int]]:
    return [engine.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def _batched(engine: Engine, prompts, params, batch: int, seed: int) -> list[list[int]]:
    """The set in groups of `batch`, each group padded with other requests to `batch` and shuffled."""
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(prompts), batch):
        idx = list(range(start, min(start + batch, len(prompts))))
        fill_p, fill_s = _neighbours(engine.vocab_size, batch - len(idx), seed + start)
        jobs = [(i, prompts[i], params[i]) for i in idx] + [(None, p, s) for p, s in zip(fill_p, fill_s, strict=True)]
        random.Random(seed + start).shuffle(jobs)
        res = engine.generate([j[1] for j in jobs], [j[2] for j in jobs])
        for (i, _, _), r in zip(jobs, res, strict=True):
            if i is not None:
                out[i] = r.token_ids
    return out


def _engine(path, dtype: str, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 32)
    return make_engine(path, dtype=dtype, deterministic=True, **kw)


@pytest.fixture(scope="module")
def references(tiny):
    """dtype -> (prompts, params, one-request-at-a-time tokens), prefix caching off; built once per dtype."""
    built: dict[str, tuple] = {}

    def get(dtype: str) -> tuple:
        if dtype not in built:
            engine = _engine(tiny, dtype, enable_prefix_caching=False)
            prompts, params = _prompt_set(engine)
            built[dtype] = (prompts, params, _alone(engine, prompts, params))
        return built[dtype]

    return get


def _cases(bf16: list, f32: list) -> list:
    """(dtype, value) parameters: every value in bf16 (the mode's reason to be) and in float32 (what a
    CPU without AVX-512 BF16 serves in; its kernel takes every row count in the mode)."""
    return [pytest.param("bfloat16", v, marks=needs_bf16) for v in bf16] + [("float32", v) for v in f32]


@pytest.mark.parametrize("dtype,batch", _cases([2, 8, 32], [2, 8, 32]))
def test_batches_with_shuffled_neighbours_match_one_request_runs(tiny, references, dtype, batch):
    prompts, params, want = references(dtype)
    engine = _engine(tiny, dtype, enable_prefix_caching=False)
    assert _batched(engine, prompts, params, batch, seed=batch) == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hits_match(tiny, references, dtype):
    prompts, params, want = references(dtype)
    engine = _engine(tiny, dtype)
    first = _batched(engine, prompts, params, 8, seed=5)  # prompts 0..7 share a prefix: hits within the run
    hits = engine.stats().prefix_cache_hits
    again = _alone(engine, prompts, params)  # every prompt's whole blocks are cached now
    assert hits > 0 and engine.stats().prefix_cache_hits > hits
    assert first == want and again == want


@pytest.mark.parametrize("dtype,budget", _cases([16, 64, 512], [16, 64, 512]))
def test_prefill_chunk_sizes_match(tiny, references, dtype, budget):
    prompts, params, want = references(dtype)
    engine = _engine(tiny, dtype, max_num_batched_tokens=budget)
    assert _batched(engine, prompts, params, 8, seed=budget) == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_preemption_matches(tiny, references, dtype):
    prompts, params, want = references(dtype)
    # 4-token blocks, room for about 5 of the 32 requests: running ones are preempted as they grow
    engine = _engine(tiny, dtype, num_kv_blocks=40, block_size=4, enable_prefix_caching=False)
    got = _batched(engine, prompts, params, 32, seed=7)
    assert engine.stats().preemptions > 0
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculative_verification_matches(tiny, references, dtype):
    prompts, params, want = references(dtype)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})  # fmt: skip
    engine = _engine(tiny, dtype, speculative=spec)
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0.0]
    got = _batched(engine, [prompts[i] for i in greedy], [params[i] for i in greedy], 8, seed=11)
    assert engine.stats().spec_draft_tokens > 0
    assert got == [want[i] for i in greedy]


# ---- the kernels, row by row ------------------------------------------------------------------------
@needs_bf16
@needs_onednn
def test_the_kernel_everywhere_keeps_rows_independent_of_the_batch(tiny, monkeypatch):
    """Where oneDNN's rows would change with the batch, the mode runs gemv_blocked at every row count:
    on cancelling inputs (any change of summation order shows) a row has the same bits alone and at
    any position among 5, 37 or 300 rows (the tile unit up to 32 rows, the AVX-512 tiles beyond, one
    order); and an engine built that way keeps the one-request tokens."""
    from engine.models.invariant_linear import cancelling_inputs
    from engine.weights import cpu_weights

    x, w = cancelling_inputs(300, 192, 400, seed=5)
    assert cpu_weights._kernel_keeps_rows(w.shape)
    lin = cpu_weights._kernel_everywhere(w, None)
    for m in (5, 37, 300):
        batch = lin(x[:m])
        for i in sorted({0, m // 2, m - 1}):
            assert torch.equal(batch[i], lin(x[i : i + 1])[0])
    monkeypatch.setattr(cpu_weights, "rows_agree", lambda *a, **k: False)
    engine = _engine(tiny, "bfloat16", enable_prefix_caching=False)
    assert "kernel, all rows" in engine.weights.gemv
    prompts, params = _prompt_set(engine)
    prompts, params = prompts[:8], params[:8]
    assert _batched(engine, prompts, params, 8, seed=3) == _alone(engine, prompts, params)


@needs_onednn
def test_tiled_onednn_rows_do_not_depend_on_the_batch():
    """Calls of at most 32 rows: each row's bits are its one-row bits at any batch size, 300 included
    (one oneDNN call of 33+ rows changes them on this machine: that is why the calls are tiled)."""
    from engine.models.invariant_linear import TiledLinear, rows_agree
    from engine.models.packed_linear import PackedLinear

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(576, 576, generator=g) * 0.04).bfloat16()
    lin = TiledLinear(w, None)
    assert rows_agree(lin, 576, torch.bfloat16)
    x = torch.randn(300, 576, generator=g).bfloat16()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(300)])
    for m in (33, 100, 300):
        assert torch.equal(lin(x[:m]), alone[:m])
    untiled = PackedLinear(w, None, 32)
    assert not all(torch.equal(untiled(x[:m]), alone[:m]) for m in (33, 100, 300))


AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@pytest.mark.skipif(not (BF16 and AMX), reason="oneDNN sums in AMX's order only on a CPU with AMX-BF16")
@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (3072, 576), (576, 1536), (100, 200)])
def test_blocked_kernel_gives_onednns_bits(shape):
    """gemv_blocked sums as oneDNN's AMX GEMM does (per 32 columns an even and an odd chain): the same
    bits at 1..32 rows on random and on cancelling inputs, where the one-chain kernel differs in many."""
    from engine.models.invariant_linear import TiledLinear, cancelling_inputs, kernel_agrees

    n, k = shape
    x, w = cancelling_inputs(32, k, n, seed=4)
    lin = TiledLinear(w, None)
    assert kernel_agrees(lin, w)
    lin.use_kernel(w)
    one_chain = torch.ops.tokenmill.gemv_pack_bf16(w.contiguous(), False)
    for m in (1, 2, 3, 7, 32):
        assert torch.equal(lin.kernel(x[:m]), lin.inner(x[:m]))
    # 40 rows: past the tile path's 32 (which multiplies as oneDNN's AMX GEMM does), the AVX-512 tiles'
    # one chain per output
    one_chain_rows = ops.gemv(torch.cat([x, x[:8]]), one_chain, None, n, k, None)[: x.shape[0]]
    differing = (one_chain_rows != lin.inner(x)).sum().item()
    assert differing > x.shape[0]  # what the check would catch if the kernel summed in its own order


@needs_bf16
@needs_onednn
def test_the_modes_small_batch_kernel_changes_no_bit(tiny):
    """In the mode, the kernel in oneDNN's order for every call of up to 32 rows (cpu_gemv "on") or for
    none ("off") gives the same tokens and log-probabilities, alone and batched; where it cannot give
    oneDNN's bits (kernel_agrees fails) the mode keeps oneDNN (kernel_rows 0)."""
    from engine.models.invariant_linear import TiledLinear

    runs = {}
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=3) for _ in prompts]
    for mode in ("on", "off"):
        engine = _engine(tiny, "bfloat16", cpu_gemv=mode)
        rows = {m.kernel_rows for m in engine.runner.model.modules() if isinstance(m, TiledLinear)}
        if mode == "off":
            assert rows == {0}
        else:  # every shape where the check passes: all of them with AMX (oneDNN's order elsewhere unknown)
            assert rows <= {0, 32} and (rows == {32} or not AMX), rows
        res = engine.generate(prompts, params) + engine.generate(prompts[:1], params[:1])
        runs[mode] = [(r.token_ids, [(lp.logprob, lp.top) for lp in r.logprobs]) for r in res]
    assert runs["on"] == runs["off"]


def test_float32_mode_takes_the_float32_kernel_at_every_row_count(tiny):
    from engine.models.cpu_linear import ALWAYS, GemvF32Linear

    engine = _engine(tiny, "float32")
    if not hasattr(ops, "gemv_f32_supported") or not ops.gemv_f32_supported():
        pytest.skip("this CPU lacks AVX2/FMA (the mode keeps one-row products)")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, GemvF32Linear)]
    assert linears and all(m.max_rows == ALWAYS for m in linears)
    g = torch.Generator().manual_seed(5)
    lin = linears[0]
    x = torch.randn(70, lin.in_features, generator=g)
    batch = lin(x)
    for i in (0, 33, 69):
        assert torch.equal(batch[i], lin(x[i : i + 1])[0])


def test_one_row_float32_linear_does_not_depend_on_the_batch():
    from engine.models.invariant_linear import RowLinear

    g = torch.Generator().manual_seed(1)
    lin = RowLinear(torch.randn(300, 200, generator=g), torch.randn(300, generator=g))
    x = torch.randn(64, 200, generator=g)
    batch = lin(x)
    for i in (0, 31, 63):
        assert torch.equal(batch[i], lin(x[i : i + 1])[0])


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
def test_decode_attention_rows_do_not_depend_on_the_batch(dtype):
    """One query row over its context gives the same bits alone and beside rows with longer contexts
    (a wider padded table, a larger max_context) at any position."""
    g = torch.Generator().manual_seed(2)
    bs, kvh, heads, d, blocks = 16, 2, 4, 32, 40
    shape = CpuAttentionBackend().kv_cache_shape(blocks, bs, kvh, d)
    k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    lens = [37, 200, 5, 120, 61]
    tables = torch.zeros(len(lens), 13, dtype=torch.long)
    perm = torch.randperm(blocks, generator=g)
    for s, n in enumerate(lens):
        tables[s, : -(-n // bs)] = perm[s * 8 : s * 8 + -(-n // bs)] if n <= 128 else perm[:13]
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    lens_t = torch.tensor(lens)
    batch = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, bs, 13 * bs, d**-0.5)
    for s, n in enumerate(lens):
        width = -(-n // bs)
        alone = ops.paged_decode_attention(q[s : s + 1], k_cache, v_cache, tables[s : s + 1, :width].contiguous(),
                                           lens_t[s : s + 1], bs, width * bs, d**-0.5)  # fmt: skip
        assert torch.equal(batch[s], alone[0])


@needs_bf16
@pytest.mark.skipif(ONEDNN, reason="oneDNN packs bf16 on this CPU: the mode tiles its calls (tests above)")
def test_without_onednn_the_mode_runs_the_kernel_at_every_row_count(tiny):
    """An AVX2-only CPU: oneDNN cannot pack bf16, so every bf16 linear of the mode (the logits head too)
    is the kernel at every row count, one chain per output whatever the rows; a row's bits alone and
    among 5, 37 and 300 rows are the same, on cancelling inputs (any change of order would show)."""
    from engine.models.cpu_linear import ALWAYS, GemvLinear
    from engine.models.invariant_linear import cancelling_inputs

    engine = _engine(tiny, "bfloat16")
    lins = [m for m in engine.runner.model.modules() if isinstance(m, GemvLinear)]
    assert len(lins) == 2 * 4 + 1 and all(m.max_rows == ALWAYS for m in lins)
    x, w = cancelling_inputs(300, 192, 400, seed=5)
    lin = GemvLinear(w, None, ALWAYS, 32, onednn=False)
    for m in (5, 37, 300):
        batch = lin(x[:m])
        for i in sorted({0, m // 2, m - 1}):
            assert torch.equal(batch[i], lin(x[i : i + 1])[0])


# ---- outside the mode ---------------------------------------------------------------------------------
@needs_bf16
def test_outside_the_mode_bf16_runs_differ(tiny):
    """The same runs without the mode: on this machine bf16 batches, prefix-cache hits and chunking
    change some request's tokens (oneDNN's GEMMs and SDPA reduce in shape-dependent orders)."""
    alone_engine = make_engine(tiny, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=32)
    prompts, params = _prompt_set(alone_engine)
    want = _alone(alone_engine, prompts, params)
    runs = {
        "batch 32": _batched(make_engine(tiny, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=32),
                             prompts, params, 32, seed=32),
        "chunks of 16": _batched(make_engine(tiny, dtype="bfloat16", max_num_batched_tokens=16, max_num_seqs=32),
                                 prompts, params, 8, seed=16),
    }  # fmt: skip
    differing = {name: sum(a != b for a, b in zip(got, want, strict=True)) for name, got in runs.items()}
    assert any(differing.values()), differing


def test_the_mode_refuses_what_it_cannot_keep(tiny):
    """The reference attention backend (SDPA for prefill) cannot give one-row attention: refused at start."""
    with pytest.raises(ValueError, match="deterministic needs the C\\+\\+ attention kernels"):
        make_engine(tiny, dtype="float32", deterministic=True, attention_backend="torch")
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        make_engine(tiny, deterministic="yes")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    from .lora_helpers import SPECS, make_adapter

    root = tmp_path_factory.mktemp("invariant-lora")
    return {name: make_adapter(tiny, root / name, spec) for name, spec in list(SPECS.items())[:2]}


def _lora_engine(tiny, adapters, dtype: str, **kw) -> Engine:
    from engine.config.lora import LoraConfig

    lora = LoraConfig(max_loras=len(adapters), max_lora_rank=16, modules=tuple((n, str(p)) for n, p in adapters.items()))
    return _engine(tiny, dtype, lora=lora, **kw)


def _on_adapters(params: list[SamplingParams], names: list, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [SamplingParams(**{**{k: getattr(p, k) for k in ("max_tokens", "temperature", "seed", "top_p")},
                              "lora_name": rng.choice(names)}) for p in params]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_adapter_batches_match_one_request_runs(tiny, references, adapters, dtype):
    """LoRA in the mode: the prompt set on the base model and two adapters, alone, then in batches of 8
    and 32 whose neighbours are on random adapters too, with prefix-cache hits and 16-token prefill
    chunks: every request's tokens equal its one-request run (the delta sums each row in a fixed
    order on every row count: engine/kernels/csrc/cpu_lora.cpp; the kernel at every chunk size)."""
    prompts, base_params, base_alone = references(dtype)
    names = [None, *adapters]
    params = _on_adapters(base_params, names, seed=7)
    engine = _lora_engine(tiny, adapters, dtype, enable_prefix_caching=False)
    want = _alone(engine, prompts, params)
    on_base = [i for i, p in enumerate(params) if p.lora_name is None]
    assert [want[i] for i in on_base] == [base_alone[i] for i in on_base]  # adapters loaded change no base row
    assert any(want[i] != base_alone[i] for i in range(len(prompts)) if params[i].lora_name)  # they matter

    def batched(eng: Engine, batch: int, seed: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(prompts), batch):
            idx = list(range(start, min(start + batch, len(prompts))))
            fill_p, fill_s = _neighbours(eng.vocab_size, batch - len(idx), seed + start)
            fill_s = _on_adapters(fill_s, names, seed + start)
            jobs = [(i, prompts[i], params[i]) for i in idx] + [(None, p, q) for p, q in zip(fill_p, fill_s, strict=True)]
            random.Random(seed + start).shuffle(jobs)
            for (i, _, _), r in zip(jobs, eng.generate([j[1] for j in jobs], [j[2] for j in jobs]), strict=True):
                if i is not None:
                    out[i] = r.token_ids
        return out

    assert batched(engine, 8, seed=8) == want
    assert batched(engine, 32, seed=32) == want
    cached = _lora_engine(tiny, adapters, dtype, enable_prefix_caching=True, max_num_batched_tokens=16)
    assert batched(cached, 8, seed=9) == want  # 16-token chunks
    assert batched(cached, 8, seed=10) == want  # the prompts' blocks now cached under their adapters
