"""GGUF files written by the tests (gguf.GGUFWriter, from the seeded presets) served by the engine:
logits (log-softmax over each step's top tokens) within 1e-4 of transformers' own GGUF load, and
greedy output token-exact in float32, for float files and for the dequantized weights of quantized
ones (`quantization="none"`; the other architectures' Q8_0 files are served quantized, `quantization="gguf"` with float activations,
within the same tolerance). Both sides dequantize with the gguf package, so a quantized file gives both the same
weights."""

from __future__ import annotations

import pytest
import torch

from .gguf_helpers import LOGPROB_TOL, TOP, gguf_path, hf_from_gguf, hf_greedy, logprob_errors, small_case
from .helpers import greedy, make_engine, mismatches

# (preset, type): every float type and the legacy quants on tiny-llama (Q/K rows permuted), a K-quant
# on tiny-llama-k (rows of 256 values, tied embeddings).
FILES = [("tiny-llama", q) for q in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")] + [("tiny-llama-k", "Q4_K")]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module", params=FILES, ids=[f"{p}-{q}" for p, q in FILES])
def served(request, build_model, gguf_dir):
    preset, qtype = request.param
    path = gguf_path(build_model, gguf_dir, preset, qtype)
    case = small_case(seed=3)
    hf = hf_from_gguf(path)
    return make_engine(path, quantization="none"), case, hf, hf_greedy(hf, case.prompts, case.max_tokens)


def test_greedy_and_logits_match_transformers_gguf_load(served):
    engine, case, _, ref = served
    res = engine.generate(case.prompts, [greedy(m, logprobs=TOP) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.tokens) == []
    errors = logprob_errors(res, ref)
    assert len(errors) == sum(len(t) for t in ref.tokens)
    assert max(errors) < LOGPROB_TOL


def test_weights_are_transformers_dequantized_weights(served):
    """The engine's parameters equal transformers' dequantized GGUF weights bit for bit (float32)."""
    engine, _, hf, _ = served
    ours = engine.runner.model
    theirs = hf.state_dict()
    layer = ours.model.layers[0]
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.split)
    assert torch.equal(q, theirs["model.layers.0.self_attn.q_proj.weight"])  # unpermuted as they are
    assert torch.equal(k, theirs["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, theirs["model.layers.0.self_attn.v_proj.weight"])
    assert torch.equal(ours.model.embed_tokens.weight, theirs["model.embed_tokens.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, theirs["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-granite", "tiny-olmo2", "tiny-phi3",
                                    "tiny-smollm3", "tiny-mistral-swa", "tiny-gemma2", "tiny-gemma3",
                                    "tiny-phi3-longrope"])
def test_other_architectures_match_transformers(build_model, gguf_dir, preset, qtype):
    """qwen2 (q/k/v biases, rows not permuted), qwen3 (q/k norms, head_dim 64 != hidden / heads),
    mistral (written as llama, as llama.cpp does), granite (Q/K permuted as llama, its four
    multipliers from granite.* metadata), olmo2 (post_attention_norm / post_ffw_norm) and phi3 (fused
    attn_qkv and ffn_up, rope.dimension_count 3/4 of the head), smollm3 (Q/K permuted, llama.cpp's fixed
    every-4th-layer NoPE), the windowed mistral (written as `mistral` with mistral.attention.sliding_window:
    llama's metadata has no window), gemma2 (both soft-caps), gemma3 (norms stored as 1 + weight, the
    local/global layer pattern, the local RoPE base and the global layers' linear rope scaling from
    gemma3.* metadata), phi3 with LongRoPE (rope_factors_long/short.weight and
    phi3.rope.scaling.original_context_length, as llama.cpp's converter writes them; prompts on both sides of
    the switch)."""
    path = gguf_path(build_model, gguf_dir, preset, qtype)
    # transformers' GGUF loader cannot load these (gemma: it reads neither the layer pattern nor the scales)
    from_folder = preset in ("tiny-qwen3", "tiny-granite", "tiny-olmo2", "tiny-phi3", "tiny-smollm3", "tiny-mistral-swa",
                             "tiny-gemma2", "tiny-gemma3", "tiny-phi3-longrope")
    hf = _qwen3_reference(build_model(preset), qtype) if from_folder else hf_from_gguf(path)
    case = small_case(seed=5)
    ref = hf_greedy(hf, case.prompts, case.max_tokens)
    # Q8_0 kept as blocks, float activations: the bit-exact path (int8 activations have their own bound:
    # tests/engine/test_gguf_quantized.py)
    blocks = dict(quantization="gguf", gguf_activations="float") if qtype == "Q8_0" else {}
    engine = make_engine(path, **blocks)
    res = engine.generate(case.prompts, [greedy(m, logprobs=TOP) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.tokens) == []
    assert max(logprob_errors(res, ref)) < LOGPROB_TOL


def _qwen3_reference(folder, qtype: str):
    """transformers' GGUF loader drops qwen3's head_dim (it cannot load tiny-qwen3's file) and has no
    granite, olmo2, smollm3 or partial-rotary phi3 (nor Gemma's metadata), so the reference is transformers
    on the source folder with every matrix put through what the test file stores: make_gguf's encoding,
    then the gguf package's dequantization (Gemma's norms: + 1, then - 1, in float32)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from engine.testing.make_gguf import TYPES, encode

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    gemma = type(hf).__name__.startswith("Gemma")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if gemma and name.endswith("norm.weight"):  # the file holds 1 + weight (float32); the loader subtracts 1
                p.copy_((p + 1.0) - 1.0)
            if p.ndim == 2:
                data, raw = encode(p.numpy().copy(), TYPES[qtype])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, raw) if raw else data.astype("float32")))
    return hf


def test_f32_file_serves_exactly_like_its_source_folder(build_model, gguf_dir):
    path = gguf_path(build_model, gguf_dir, "tiny-llama", "F32")
    case = small_case(seed=7)
    params = [greedy(m, logprobs=2) for m in case.max_tokens]
    a = make_engine(build_model("tiny-llama")).generate(case.prompts, params)
    b = make_engine(path).generate(case.prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [[x.logprob for x in r.logprobs] for r in a] == [[x.logprob for x in r.logprobs] for r in b]


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0", "Q4_1"])
def test_auto_dtype_serves_quantized_files_in_bf16_where_bf16_is_fast(build_model, gguf_dir, qtype):
    from engine.runner.startup import cpu_bf16_fast, resolve_dtype
    from engine.weights.model_open import open_model_source

    source = open_model_source(str(gguf_path(build_model, gguf_dir, "tiny-llama", qtype)))
    got = resolve_dtype("auto", source.hf_config, torch.device("cpu"))
    quantized = qtype.startswith("Q")
    want = torch.bfloat16 if qtype == "BF16" or (quantized and cpu_bf16_fast()) else torch.float32
    assert got == want
    assert resolve_dtype("float32", source.hf_config, torch.device("cpu")) == torch.float32  # asked for: kept


def test_bf16_is_fast_wherever_the_bf16_linear_kernel_has_a_path(monkeypatch):
    """An AVX2-only CPU has no bf16 instructions, but the bf16 kernel widens bf16 in registers there:
    quantized files then serve in bf16 (1.8-2x float32's decode on a Zen 3). Without the kernel (no
    compiler, a CPU without AVX2) it is the bf16 instructions alone that decide."""
    from engine.kernels import cpu_kernels
    from engine.runner import startup

    path = cpu_kernels.linear_path("bf16")
    assert path in ("AMX", "AVX-512", "AVX2", "none")
    assert startup.cpu_bf16_fast() == (startup.cpu_has_bf16() or path != "none")
    if cpu_kernels.load("linear") is None and path != "none":  # this CPU has AVX2 at least
        assert startup.cpu_bf16_fast()
    monkeypatch.setattr(cpu_kernels, "load", lambda group: "no compiler here")
    assert cpu_kernels.linear_path("bf16") == "none"
    assert startup.cpu_bf16_fast() == startup.cpu_has_bf16()
