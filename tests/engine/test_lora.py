"""LoRA adapters (engine/lora/): greedy output on each PEFT adapter equals transformers + PEFT (float32),
alone and in one batch with the base model and other adapters, under preemption, with prefix-cache hits
that never cross adapters; bad adapters are refused with typed errors, nothing half-loaded."""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.api import InvalidParam
from engine.api.errors import (
    LoraBaseMismatch,
    LoraFilesMissing,
    LoraNameTaken,
    LoraRankTooHigh,
    LoraShapeError,
    LoraUnknown,
    LoraUnsupportedTarget,
)
from engine.config.lora import LoraConfig

from .helpers import TINY_PRESETS, assert_idle, make_engine
from .lora_helpers import SPECS, AdapterSpec, make_adapter, peft_greedy, random_prompts

LENGTHS = [1, 9, 40, 75, 130]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=TINY_PRESETS)
def family(request, build_model, tmp_path_factory):
    """(preset path, {name: adapter folder}, prompts, {None or name: reference outputs})"""
    from transformers import AutoConfig

    path = build_model(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {name: make_adapter(path, root / name, spec) for name, spec in SPECS.items()}
    prompts = random_prompts(AutoConfig.from_pretrained(str(path)).vocab_size, LENGTHS, seed=5)
    refs = {None: peft_greedy(path, None, prompts, MAX_TOKENS)}
    refs.update({name: peft_greedy(path, folder, prompts, MAX_TOKENS) for name, folder in adapters.items()})
    for name in adapters:  # the adapters must matter, or parity would prove nothing
        assert refs[name] != refs[None], f"adapter {name} does not change the output"
    return path, adapters, prompts, refs


def lora_engine(path, adapters, **kw):
    cfg = LoraConfig(max_loras=kw.pop("max_loras", 4), max_lora_rank=16, modules=tuple((n, str(p)) for n, p in adapters.items()))
    return make_engine(path, lora=cfg, **kw)


def greedy_on(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora_name=name)


def run(engine, prompts, names):
    res = engine.generate([list(p) for p in prompts], [greedy_on(n) for n in names])
    return [r.token_ids for r in res]


def record_batches(engine) -> list[int]:
    """Adapters per step with adapter rows (appended as the engine runs)."""
    seen: list[int] = []
    inner = engine.runner._lora_batch

    def spy(items):
        batch = inner(items)
        if batch is not None:
            seen.append(len(batch.segments))
        return batch

    engine.runner._lora_batch = spy
    return seen


def test_each_adapter_alone_matches_peft(family):
    path, adapters, prompts, refs = family
    engine = lora_engine(path, adapters)
    for name in [None, *adapters]:
        assert run(engine, prompts, [name] * len(prompts)) == refs[name], name
    assert_idle(engine)


def test_mixed_batch_base_and_three_adapters_matches_peft(family):
    path, adapters, prompts, refs = family
    engine = lora_engine(path, adapters)
    seen = record_batches(engine)
    names = [None, *adapters]
    jobs = [(p, n, i) for i, p in enumerate(prompts) for n in names]
    got = run(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    for out, (_, name, i) in zip(got, jobs, strict=True):
        assert out == refs[name][i], (name, i)
    assert max(seen) == 3  # one step held rows of all three adapters (and the base model's)
    assert_idle(engine)


def test_preemption_keeps_adapter_parity(family):
    path, adapters, prompts, refs = family
    # 16-token blocks: the longest request needs 9, the batch far more
    engine = lora_engine(path, adapters, num_kv_blocks=14, block_size=16)
    names = [None, *adapters]
    jobs = [(p, n, i) for i, p in enumerate(prompts) for n in names]
    got = run(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    assert engine.stats().preemptions > 0
    for out, (_, name, i) in zip(got, jobs, strict=True):
        assert out == refs[name][i], (name, i)
    assert_idle(engine)


def test_prefix_cache_is_never_shared_across_adapters(family):
    path, adapters, prompts, refs = family
    engine = lora_engine(path, adapters, block_size=16)
    prompt, i = prompts[-1], len(prompts) - 1  # 130 tokens: 8 full blocks

    def once(name):
        res = engine.generate([list(prompt)], [greedy_on(name)])[0]
        assert res.token_ids == refs[name][i], name
        return res.cached_tokens

    assert once(None) == 0
    assert once("all") == 0  # the base model's blocks are not the adapter's
    assert once("all") >= 128  # its own are
    assert once("attn") == 0  # nor another adapter's
    assert once(None) >= 128
    assert_idle(engine)


def test_max_loras_limits_adapters_per_step_and_pages_lru(build_model, tmp_path):
    path = build_model("tiny-llama")
    adapters = {name: make_adapter(path, tmp_path / name, spec) for name, spec in SPECS.items()}
    from transformers import AutoConfig

    prompts = random_prompts(AutoConfig.from_pretrained(str(path)).vocab_size, [12, 30], seed=9)
    refs = {n: peft_greedy(path, a, prompts, MAX_TOKENS) for n, a in adapters.items()}
    engine = lora_engine(path, adapters, max_loras=1)
    seen = record_batches(engine)
    jobs = [(p, n, i) for n in adapters for i, p in enumerate(prompts)]
    got = run(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    for out, (_, name, i) in zip(got, jobs, strict=True):
        assert out == refs[name][i], (name, i)
    assert max(seen) == 1
    stats = engine.stats()
    assert stats.lora_loads >= 3 and engine.loras.num_resident == 1  # paged in, the LRU one out
    assert_idle(engine)


# -- load, unload, refusals --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(build_model, tmp_path_factory):
    path = build_model("tiny-llama")
    root = tmp_path_factory.mktemp("lora-errors")
    return path, root, make_adapter(path, root / "good", SPECS["all"])


def _broken_copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_unload_lets_requests_in_flight_finish(llama):
    path, _, good = llama
    engine = lora_engine(path, {})
    info = engine.load_lora("a", str(good))
    assert info.rank == 8 and info.lora_id > 0 and [i.name for i in engine.list_loras()] == ["a"]
    prompt = [11, 12, 13, 14, 15]
    ref = peft_greedy(path, good, [prompt], MAX_TOKENS)[0]
    engine.add_request("r1", prompt_token_ids=prompt, params=greedy_on("a"))
    out = engine.step()
    engine.unload_lora("a")
    with pytest.raises(InvalidParam) as exc:  # gone for new requests at once
        engine.add_request("r2", prompt_token_ids=prompt, params=greedy_on("a"))
    assert exc.value.field == "model"
    tokens = [t for o in out for t in o.new_token_ids]
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == ref  # the request in flight finished on its adapter
    assert engine.loras._retired == {} and engine.loras.num_resident == 0  # and then its weights went
    again = engine.load_lora("a", str(good))  # a reload is a new adapter: no cached block is shared
    assert again.lora_id != info.lora_id
    assert_idle(engine)


def _refused(engine, name, path, error):
    with pytest.raises(error) as exc:
        engine.load_lora(name, str(path))
    assert engine.list_loras() == [] and exc.value.field == "lora_path"  # nothing half-loaded
    with pytest.raises(InvalidParam):
        engine.add_request("x", prompt_token_ids=[11, 12], params=greedy_on(name))
    return str(exc.value)


def test_bad_adapters_are_refused_naming_the_problem(llama, build_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path, root, good = llama
    engine = lora_engine(path, {})
    assert "is not a folder" in _refused(engine, "m", tmp_path / "nope", LoraFilesMissing)
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in _refused(engine, "m", tmp_path / "empty", LoraFilesMissing)
    # rank above max_lora_rank
    high = make_adapter(path, tmp_path / "high", AdapterSpec(32, 32, ("q_proj",)))
    assert "max_lora_rank (16)" in _refused(engine, "h", high, LoraRankTooHigh)
    # made for another base model (tiny-qwen3: q_proj 128 -> 256; tiny-llama's 128 -> 128)
    other = make_adapter(build_model("tiny-qwen3"), tmp_path / "other", AdapterSpec(4, 8, ("q_proj",)))
    assert "another base model" in _refused(engine, "o", other, LoraBaseMismatch)
    # A and B ranks disagree
    bad = _broken_copy(good, tmp_path / "shape")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("layers.1.mlp.down_proj.lora_B.weight"))
    tensors[key] = tensors[key][:, :3].contiguous()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    assert "layer 1 down_proj" in _refused(engine, "s", bad, LoraShapeError)
    # a target module we do not adapt
    emb = _broken_copy(good, tmp_path / "emb")
    cfg = json.loads((emb / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    (emb / "adapter_config.json").write_text(json.dumps(cfg))
    assert "embed_tokens" in _refused(engine, "e", emb, LoraUnsupportedTarget)
    head = make_adapter(path, tmp_path / "head", AdapterSpec(4, 8, ("lm_head",)))
    assert "lm_head" in _refused(engine, "l", head, LoraUnsupportedTarget)
    # names
    engine.load_lora("g", str(good))
    with pytest.raises(LoraNameTaken):
        engine.load_lora("g", str(good))
    with pytest.raises(LoraUnknown):
        engine.unload_lora("nobody")
    assert [i.name for i in engine.list_loras()] == ["g"]


def test_lora_off_refuses_adapter_requests(llama):
    path, _, good = llama
    engine = make_engine(path)
    with pytest.raises(InvalidParam) as exc:
        engine.add_request("x", prompt_token_ids=[11, 12], params=greedy_on("a"))
    assert exc.value.field == "model" and "not enabled" in exc.value.message
    with pytest.raises(InvalidParam):
        engine.load_lora("a", str(good))


def test_scale_folding_matches_peft_formula():
    """rsLoRA scales by alpha / sqrt(r), plain LoRA by alpha / r (PEFT's)."""
    from engine.lora.adapter import _scale

    assert _scale({"lora_alpha": 16}, 0, "q_proj", 4) == 4.0
    assert _scale({"lora_alpha": 16, "use_rslora": True}, 0, "q_proj", 4) == 8.0
    assert _scale({"lora_alpha": 16, "alpha_pattern": {"down_proj": 2}}, 1, "down_proj", 2) == 1.0


def test_delta_rides_on_the_int8_kernels(family):
    """The delta is added on top of whatever base product runs: INT8 with the C++ kernels (int16
    activations; gate/up interleaved for the fused activation) gives the greedy tokens of INT8 dequantized
    + PyTorch in a batch mixing the base model and three adapters (float32), up to the first near-tie
    (top-2 within 0.01 nats, where the kernels' activation rounding may pick the other token)."""
    from engine.models import cpu_linear

    reason = cpu_linear.kernels_unavailable("int8")
    if reason is not None:
        pytest.skip(f"INT8 linear kernels unavailable here: {reason}")
    path, adapters, prompts, refs = family
    names = [None, *adapters]
    jobs = [(p, n) for p in prompts for n in names]

    def outputs(gemv):
        engine = lora_engine(path, adapters, quantization="int8", cpu_gemv=gemv)
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, lora_name=n) for _, n in jobs]
        return engine.generate([list(p) for p, _ in jobs], params)

    on, off = outputs("on"), outputs("off")
    compared = 0
    for a, b in zip(on, off, strict=True):
        for i, (t_on, t_off, lp) in enumerate(zip(a.token_ids, b.token_ids, b.logprobs, strict=False)):
            if len(lp.top) > 1 and lp.top[0][1] - lp.top[1][1] < 0.01:
                break  # a near-tie: either token is right
            assert t_on == t_off, (i, a.token_ids, b.token_ids)
            compared += 1
    assert compared >= len(jobs) * MAX_TOKENS // 2
    by_name = {n: [o.token_ids for o, (_, m) in zip(off, jobs, strict=True) if m == n] for n in names}
    assert all(by_name[n] != by_name[None] for n in adapters)  # the adapters change the output


def test_a_refused_startup_adapter_stops_the_engine_naming_it(llama, tmp_path):
    path, _, good = llama
    with pytest.raises(LoraFilesMissing, match="lora module 'bad'"):
        lora_engine(path, {"good": good, "bad": tmp_path / "missing"})


def fused_and_python_runs(path, adapters, jobs, **engine_kw):
    """The same greedy jobs [(prompt, adapter or None)] on an engine with the C++ layer loop and on one
    without: each run's (tokens, log-probabilities); the loop's also counts its decode steps that had
    adapter rows."""

    def go(fused: bool):
        engine = lora_engine(path, adapters, fused_decode=fused, **engine_kw)
        taken = []
        if fused:
            inner = engine.runner.model.model.fused_decode.run

            def counted(x, ctx):
                out = inner(x, ctx)
                taken.append(out is not None and ctx.lora is not None)
                return out

            engine.runner.model.model.fused_decode.run = counted
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora_name=n, logprobs=2) for _, n in jobs]
        res = engine.generate([list(p) for p, _ in jobs], params)
        return [r.token_ids for r in res], [[(lp.logprob, lp.top) for lp in r.logprobs] for r in res], sum(taken)

    return go(True), go(False)


def test_mixed_adapter_decode_steps_run_in_the_cpp_loop_bit_for_bit(family):
    """float32: a decode step with adapter rows goes through the C++ layer loop (engine/kernels/csrc/cpu_decode.cpp,
    which adds the deltas with tokenmill::lora_add_) and gives the Python layers' log-probabilities
    bit for bit."""
    path, adapters, prompts, refs = family
    names = [None, *adapters]
    jobs = [(p, n) for p in prompts for n in names]
    (got_tokens, got_lps, lora_steps), (want_tokens, want_lps, _) = fused_and_python_runs(path, adapters, jobs)
    assert got_tokens == want_tokens
    assert got_lps == want_lps
    assert lora_steps >= MAX_TOKENS - 2  # the adapter rows' decode steps took the C++ loop
    for (_, name), out, i in zip(jobs, got_tokens, [i for i in range(len(prompts)) for _ in names], strict=True):
        assert out == refs[name][i], (name, i)


@pytest.mark.parametrize("gemv", ["on", "off"])
def test_bf16_adapter_decode_steps_run_in_the_cpp_loop_bit_for_bit(family, gemv):
    """bf16 (what an AVX-512 BF16 CPU serves): the delta is the C++ kernel's (bf16 pairs) in the
    Python layers and in the C++ layer loop alike, which takes the adapter rows' decode steps (the
    gate/up as a plain product, the delta, then the activation) and gives the same log-probabilities
    bit for bit, with the small-batch kernels on and off."""
    from engine.lora.batch import kernel_available

    from .helpers import require_cpu_kernels

    require_cpu_kernels()
    ops = torch.ops.tokenmill
    bf16_gemv = hasattr(ops, "gemv_supported") and ops.gemv_supported("bf16")
    assert kernel_available()  # the delta's kernel builds on every CPU the kernels build on
    if gemv == "on" and not bf16_gemv:
        pytest.skip("the bf16 small-batch kernels are unavailable here: this CPU lacks AVX-512 BF16")
    path, adapters, prompts, _ = family
    names = [None, *adapters]
    jobs = [(p, n) for p in prompts[:4] for n in names]
    (got_tokens, got_lps, lora_steps), (want_tokens, want_lps, _) = fused_and_python_runs(
        path, adapters, jobs, dtype="bfloat16", cpu_gemv=gemv)
    assert got_tokens == want_tokens
    assert got_lps == want_lps
    assert lora_steps >= MAX_TOKENS - 2
    by_name = {n: [t for (_, m), t in zip(jobs, got_tokens, strict=True) if m == n] for n in names}
    assert all(by_name[n] != by_name[None] for n in adapters)  # the adapters still change the output


def _mixed_batch_matches_peft(path, tmp_path, specs: dict, seed: int):
    """Adapters made from `specs` on the model at `path`, served in one batch with the base model:
    every row equals PEFT's greedy tokens, and each adapter changes them. Returns (engine, adapters)."""
    from transformers import AutoConfig

    adapters = {name: make_adapter(path, tmp_path / name, spec) for name, spec in specs.items()}
    prompts = random_prompts(AutoConfig.from_pretrained(str(path)).vocab_size, LENGTHS[:3], seed=seed)
    refs = {name: peft_greedy(path, adapters.get(name), prompts, MAX_TOKENS) for name in [None, *adapters]}
    engine = lora_engine(path, adapters)
    jobs = [(p, n, i) for i, p in enumerate(prompts) for n in refs]
    got = run(engine, [p for p, _, _ in jobs], [n for _, n, _ in jobs])
    assert [(n, i) for out, (_, n, i) in zip(got, jobs, strict=True) if out != refs[n][i]] == []
    assert all(refs[name] != refs[None] for name in adapters)  # the adapters matter
    return engine, adapters


@pytest.mark.parametrize("preset", ["tiny-olmo2", "tiny-granite", "tiny-smollm3", "tiny-gemma2", "tiny-gemma3"])
def test_other_families_adapters_match_peft(build_model, tmp_path, preset):
    """PEFT adapters on OLMo 2 (the delta before the whole-projection Q/K norms), Granite (before the
    residual multiplier), SmolLM3 (NoPE layers), Gemma 2 (GeGLU: the gate/up delta before gelu_tanh;
    soft-caps, sliding windows) and Gemma 3 (the delta before its per-head Q/K norms, local and global
    RoPE): a mixed batch of the base model and every adapter, on the Python layers (the C++ decode loop
    declines these models), equal to PEFT's greedy tokens."""

    path = build_model(preset)
    engine, adapters = _mixed_batch_matches_peft(path, tmp_path, SPECS, seed=6)
    assert_idle(engine)


def test_phi3_adapters_on_its_fused_projections_match_peft(build_model, tmp_path):
    """Phi-3's PEFT adapters target the checkpoint's fused qkv_proj and gate_up_proj (one shard each);
    mixed with o/down targets and the base model in one batch, equal to PEFT's greedy tokens. A
    Llama adapter's q_proj has no place in Phi-3: refused by name, nothing loaded."""

    path = build_model("tiny-phi3")
    specs = {"fused": AdapterSpec(8, 16, ("qkv_proj", "gate_up_proj"), seed=1),
             "all": AdapterSpec(4, 8, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), rslora=True, seed=2)}
    engine, adapters = _mixed_batch_matches_peft(path, tmp_path, specs, seed=7)
    llama_adapter = make_adapter(build_model("tiny-llama"), tmp_path / "llama", AdapterSpec(4, 8, ("q_proj",)))
    loaded = engine.list_loras()
    with pytest.raises(LoraBaseMismatch, match="'q_proj' is not a projection of the base model"):
        engine.load_lora("x", str(llama_adapter))
    assert engine.list_loras() == loaded  # nothing half-loaded
    assert_idle(engine)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_moe_adapters_on_attention_match_peft_and_expert_targets_are_refused(build_model, tmp_path, preset):
    """A mixture-of-experts model takes adapters on its attention projections (a mixed batch with the
    base model, equal to PEFT's greedy tokens); an adapter whose target_modules name an MLP projection,
    or whose file holds an expert's matrices, is refused naming target_modules, nothing loaded."""
    from safetensors.torch import load_file, save_file

    path = build_model(preset)
    specs = {"attn": AdapterSpec(8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
             "qv": AdapterSpec(4, 8, ("q_proj", "v_proj"), rslora=True, seed=2)}
    engine, adapters = _mixed_batch_matches_peft(path, tmp_path, specs, seed=8)
    loaded = engine.list_loras()
    # target_modules naming an MLP projection
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    (mlp / "adapter_model.safetensors").write_bytes((adapters["qv"] / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    (mlp / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "gate_proj"]}))
    with pytest.raises(LoraUnsupportedTarget, match=r"target_modules \['gate_proj'\].*mixture-of-experts.*q_proj"):
        engine.load_lora("mlp", str(mlp))
    # an expert's matrices in the file (target_modules a regex: the tensors say what it matched)
    experts = tmp_path / "experts"
    experts.mkdir()
    tensors = load_file(str(adapters["qv"] / "adapter_model.safetensors"))
    a = next(t for k, t in tensors.items() if "lora_A" in k)
    tensors["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"] = a.clone()
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    (experts / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ".*proj"}))
    with pytest.raises(LoraUnsupportedTarget, match="experts.0.gate_proj.*mixture-of-experts.*target_modules"):
        engine.load_lora("experts", str(experts))
    assert engine.list_loras() == loaded  # nothing half-loaded
    assert_idle(engine)
