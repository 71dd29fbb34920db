"""Mixture-of-experts models (engine/models/moe.py) with the engine's other features: the checkpoint
layouts the loader takes, INT8 (attention and dense linears; experts kept), the batch-invariant mode
(refused), a checkpoint missing an expert (refused). Parity with transformers under batching, chunked
prefill, preemption and prefix hits: tests/engine/test_parity.py (MOE_PRESETS)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.cpu_linear import Int8Linear
from engine.models.moe import SparseMoeBlock

from .helpers import greedy, make_case, make_engine

N_EXPERTS = 8


def _generate(engine, case) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])]


def _small_case():
    case = make_case(vocab=2000, n=6, seed=9)
    case.max_tokens = [12] * len(case.prompts)
    return case


def _rewrite(src, dst, change) -> None:
    """A copy of the model folder `src` at `dst` whose tensors went through change(dict) -> dict."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(change(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_fused_expert_checkpoints_load_as_the_per_expert_ones(build_model, tmp_path, preset):
    """transformers 5 holds experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]); the files it
    writes (and older checkpoints) name each expert's matrices. Both load to the same tokens."""
    path = build_model(preset)
    prefix = "block_sparse_moe" if preset == "tiny-mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if preset == "tiny-mixtral" else ("gate_proj", "up_proj", "down_proj")

    def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        layers = sorted({int(k.split(".")[2]) for k in tensors if ".experts." in k})
        for i in layers:
            stem = f"model.layers.{i}.{prefix}.experts"
            out[f"{stem}.gate_up_proj"] = torch.stack([
                torch.cat([tensors[f"{stem}.{e}.{gate}.weight"], tensors[f"{stem}.{e}.{up}.weight"]])
                for e in range(N_EXPERTS)])  # fmt: skip
            out[f"{stem}.down_proj"] = torch.stack([tensors[f"{stem}.{e}.{down}.weight"] for e in range(N_EXPERTS)])
        assert len(out) < len(tensors)  # the rewrite really fused something
        return out

    _rewrite(path, tmp_path / "fused", fuse)
    case = _small_case()
    assert _generate(make_engine(tmp_path / "fused"), case) == _generate(make_engine(path), case)


def test_a_missing_expert_is_refused_naming_it(build_model, tmp_path):
    path = build_model("tiny-qwen3-moe")
    _rewrite(path, tmp_path / "missing",
             lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.experts.5.up_proj.weight"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.0\.mlp\.experts\.gate_up_proj#5\.1"):
        make_engine(tmp_path / "missing")


def test_an_expert_beyond_the_configs_count_is_refused(build_model, tmp_path):
    path = build_model("tiny-olmoe")
    shutil.copytree(path, tmp_path / "fewer")
    cfg = json.loads((tmp_path / "fewer" / "config.json").read_text())
    (tmp_path / "fewer" / "config.json").write_text(json.dumps({**cfg, "num_experts": 4}))
    with pytest.raises(ValueError, match="has shape|expert 4 of 4"):
        make_engine(tmp_path / "fewer")


def test_int8_quantizes_every_linear_experts_included_and_keeps_the_routers(build_model):
    """--quantization int8 on an MoE model: every nn.Linear (attention, Qwen3-MoE's dense layer, the
    logits head) and every expert's gate_up and down become INT8 (the experts' stacks dropped); the
    router stays float32, and the start-up report says so. The tokens stay close to float32's: the
    first token of each prompt equal where float32's top token leads clearly."""
    path = build_model("tiny-qwen3-moe")
    engine = make_engine(path, quantization="int8")
    model = engine.runner.model
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert isinstance(layer0.self_attn.qkv_proj, Int8Linear) and isinstance(layer1.mlp.down_proj, Int8Linear)
    assert isinstance(layer0.mlp, SparseMoeBlock)
    experts = layer0.mlp.experts
    assert experts.gate_up is not None and experts.down is not None and len(experts.gate_up) == N_EXPERTS
    assert all(isinstance(m, Int8Linear) for m in [*experts.gate_up, *experts.down])
    assert experts.gate_up_proj.numel() == 0 and layer0.mlp.gate.weight.dtype == torch.float32
    assert engine.weights.quantization is not None and "experts included" in engine.weights.quantization
    case = make_case(vocab=2000, n=16, seed=11)
    ref = make_engine(path).generate(case.prompts, greedy(1, logprobs=2))
    got = engine.generate(case.prompts, greedy(1))
    clear = [i for i, r in enumerate(ref) if r.logprobs[0].top[0][1] - r.logprobs[0].top[1][1] > 0.2]
    assert len(clear) >= 4
    assert [i for i in clear if got[i].token_ids != ref[i].token_ids] == []


def test_cpu_experts_take_the_dense_linears_kernels(build_model):
    """On the CPU each expert's matrices become the linear modules the dense layers get (float32: the
    small-batch kernel, GemvF32Linear), and the stacks are dropped; the tokens are the stacked path's
    (parity with transformers: test_parity.py)."""
    from engine.models.cpu_linear import GemvF32Linear

    path = build_model("tiny-olmoe")
    engine = make_engine(path)
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.gate_up is not None and all(isinstance(m, GemvF32Linear) for m in experts.gate_up)
    plain = make_engine(path, cpu_gemv="off")
    assert plain.runner.model.model.layers[0].mlp.experts.gate_up is None  # F.linear over the stacks
    case = _small_case()
    assert _generate(engine, case) == _generate(plain, case)


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-gpt-oss"])  # GPT-OSS: router bias, sinks, window
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_mode_keeps_a_requests_tokens_whatever_its_neighbours(build_model, dtype, preset):
    """--deterministic on an MoE model: the routers' float32 logits and every expert's product on the
    mode's row-invariant kernels, the sum back per token in expert order: each request's tokens alone,
    in one batch with its neighbours, and with 16-token steps (prompts chunked) are the same, in bf16
    (where the default path's differ) and float32."""
    from engine.kernels import cpu_kernels

    from .helpers import require_cpu_kernels

    require_cpu_kernels()
    if dtype == "bfloat16" and not torch.ops.tokenmill.gemv_supported("bf16"):
        pytest.skip("this CPU lacks AVX2/FMA (the mode refuses bf16 weights there)")
    assert cpu_kernels.load("linear") is None
    path = build_model(preset)
    case = make_case(vocab=2000, n=12, seed=17)
    case.max_tokens = [10] * len(case.prompts)
    engine = make_engine(path, dtype=dtype, deterministic=True)
    router = engine.runner.model.model.layers[0].mlp.gate
    assert router.invariant is not None
    alone = [engine.generate([p], greedy(m))[0].token_ids for p, m in zip(case.prompts, case.max_tokens, strict=True)]
    assert _generate(engine, case) == alone
    assert _generate(make_engine(path, dtype=dtype, deterministic=True, max_num_batched_tokens=16), case) == alone


def test_expert_token_counts_for_debugging(build_model):
    """Every sparse layer counts the tokens routed to each expert from start-up (Engine.expert_counts,
    the admin API's experts endpoint): top-k per token, every token each layer ran; a dense model has none."""
    engine = make_engine(build_model("tiny-qwen2-moe"))
    assert engine.expert_counts() == [[0] * N_EXPERTS, [0] * N_EXPERTS]
    case = _small_case()
    results = engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])
    counts = engine.expert_counts()
    assert counts is not None and len(counts) == 2 and all(len(c) == N_EXPERTS for c in counts)
    # each prompt token and each generated token but the last (never fed back) goes through once, top-2
    ran = sum(len(p) + len(r.token_ids) - 1 for p, r in zip(case.prompts, results, strict=True))
    assert sum(counts[0]) == sum(counts[1]) == 2 * ran
    assert make_engine(build_model("tiny-llama")).expert_counts() is None


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral", "tiny-gpt-oss"])
def test_speculative_drafts_are_routed_like_any_token(build_model, preset):
    """Verification rows (a request's drafts, several positions in one step) go through the experts as
    any token does: with drafts (every third one wrong) the greedy tokens stay those without."""
    from .helpers import spec_engine
    from .test_speculative import SPEC, OracleProposer

    path = build_model(preset)
    case = make_case(vocab=2000, n=8, seed=13)
    ref = _generate(make_engine(path), case)
    engine = spec_engine(path, speculative=SPEC)
    engine.scheduler.proposer = OracleProposer({f"r{i}": r for i, r in enumerate(ref)}, 2000)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(case.prompts))}
    for i, (prompt, m) in enumerate(zip(case.prompts, case.max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=greedy(m))
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(len(case.prompts))] == ref
    st = engine.stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens


def test_moe_models_decline_cuda_graphs(build_model):
    """grouped_experts reads the per-expert counts on the host: a CUDA graph cannot capture that, so the
    engine runs an MoE model's decode steps eagerly (engine.py logs why); dense models keep the graphs."""
    moe = make_engine(build_model("tiny-mixtral")).runner.model
    dense = make_engine(build_model("tiny-llama")).runner.model
    assert "host" in (moe.cuda_graphs_unsupported() or "") and dense.cuda_graphs_unsupported() is None


@pytest.mark.parametrize("cpu_gemv", ["auto", "off"])
def test_weight_bytes_count_the_experts_a_token_reads(build_model, cpu_gemv):
    """The report's weight bytes (what a one-token decode step reads) count top_k / num_experts of the
    experts' bytes: 2 of 8 here, whether the experts are kernel linears or still stacked."""
    path = build_model("tiny-olmoe")
    engine = make_engine(path, cpu_gemv=cpu_gemv)
    cfg = engine.hf_config
    h, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    attn = h * (h + 2 * 2 * 32) + h * h  # qkv (4 heads + 2 KV heads of 32) and o
    experts = 8 * 3 * h * inter
    want = 4 * (layers * (attn + experts * 2 // 8) + vocab * h)  # float32; untied head
    got = engine.weights.weight_bytes
    assert abs(got - want) / want < 0.02  # the float32 kernel pads its layout to whole blocks
