"""GGUF files served with their quantized matrices kept quantized (opt-in on the CPU,
`quantization="gguf"`; engine/weights/gguf/blocks.py, engine/models/gguf_linear.py) against the same
file served dequantized (`quantization="none"`, the parity suite's engine, transformers-exact), for
every kernel type and a Q4_K_M-like mix (engine/testing/make_gguf.py's MIX: q/k/gate/up Q5_0, v Q8_0,
o Q4_K, down and head Q6_K, embedding Q8_0, so q/k/v are a stack of two types).

With float activations (gguf_activations="float") both compute with the same weight values (the kernel
decodes gguf's dequantized values bit for bit) in float32; only the summation order differs (8-lane
FMAs against MKL's), so greedy tokens are equal for every prompt and every generated token (all of
them: N = each prompt's max_tokens, 8 to 24), served six prompts at once (batched decode, chunked
prefill) and with prefill chunks above the kernel's rows (the dequantize-per-call path). With int8
activations (the default) the products are within kernels/ggml.h's bound, not equal: the test states
what it asserts there."""

from __future__ import annotations

import pytest
import torch

from engine.models.gguf_linear import GGMLEmbedding, GGMLLinear, GGMLStack

from .gguf_helpers import gguf_path, small_case
from .helpers import greedy, make_engine, mismatches, require_cpu_kernels

require_cpu_kernels("ggml", "linear")

# (preset, type): the 32-value types on tiny-llama (untied, Q/K rows permuted), every type on
# tiny-llama-k (tied: the head and the embedding lookup share the blocks; rows of 256 values, so the
# K-quants take every matrix), and the mix.
FILES = [("tiny-llama", "Q8_0"), ("tiny-llama", "Q4_0"), ("tiny-llama", "Q4_1"), ("tiny-llama", "Q5_0"),
         ("tiny-llama", "Q5_1"), ("tiny-llama-k", "Q4_1"), ("tiny-llama-k", "Q4_K"), ("tiny-llama-k", "Q5_K"),
         ("tiny-llama-k", "Q6_K"), ("tiny-llama", "MIX"), ("tiny-llama-k", "MIX")]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-q")


def _linears(engine) -> list[torch.nn.Module]:
    """The block linears that multiply (an untied embedding's blocks are only looked up)."""
    model = engine.runner.model
    lookup = model.model.embed_tokens.source if isinstance(model.model.embed_tokens, GGMLEmbedding) else None
    return [m for m in model.modules() if isinstance(m, GGMLLinear) and (m is not lookup or m is model.lm_head)]


@pytest.mark.parametrize(("preset", "qtype"), FILES, ids=[f"{p}-{q}" for p, q in FILES])
@pytest.mark.parametrize("cpu_gemv", ["auto", "on"])
def test_quantized_greedy_equals_dequantized(build_model, gguf_dir, preset, qtype, cpu_gemv):
    path = gguf_path(build_model, gguf_dir, preset, qtype)
    case = small_case(seed=5)
    params = [greedy(m) for m in case.max_tokens]
    ref = make_engine(path, quantization="none").generate(case.prompts, params)
    engine = make_engine(path, cpu_gemv=cpu_gemv, max_num_batched_tokens=64, quantization="gguf",
                         gguf_activations="float")  # chunks of 64
    res = engine.generate(case.prompts, params)
    assert mismatches([r.token_ids for r in res], [r.token_ids for r in ref]) == []
    model = engine.runner.model
    text = engine.weights.quantization
    assert text.endswith("; float activations") and "dequantized" not in text  # every matrix kept
    assert text.startswith(f"gguf ({qtype}") or "Q8_0" in text or qtype == "MIX"
    layer = model.model.layers[0]
    if qtype == "MIX":  # (tiny-llama's rows of 64 / 192 values: its K-quant matrices fall back to Q8_0)
        assert isinstance(layer.self_attn.qkv_proj.weight_q, GGMLStack)
        assert layer.self_attn.qkv_proj.weight_q.types == ["Q5_0", "Q8_0"]
        if preset == "tiny-llama-k":
            assert text.startswith("gguf (Q4_K, Q5_0, Q6_K, Q8_0)")
            assert layer.mlp.down_proj.weight_q.type_name == "Q6_K"
            assert layer.self_attn.o_proj.weight_q.type_name == "Q4_K"
    assert isinstance(layer.self_attn.qkv_proj, GGMLLinear) and isinstance(layer.mlp.gate_up_proj, GGMLLinear)
    assert isinstance(model.model.embed_tokens, GGMLEmbedding) and isinstance(model.lm_head, GGMLLinear)
    tied = preset == "tiny-llama-k"
    assert (model.model.embed_tokens.source is model.lm_head) == tied
    if cpu_gemv == "on":
        assert all(lin.max_rows > 1 << 40 for lin in _linears(engine))


def test_quantized_bf16_serves_and_reads_fewer_bytes(build_model, gguf_dir):
    path = gguf_path(build_model, gguf_dir, "tiny-llama", "Q4_0")
    case = small_case(seed=6)
    params = [greedy(m) for m in case.max_tokens]
    q = make_engine(path, dtype="bfloat16", quantization="gguf")
    d = make_engine(path, dtype="bfloat16", quantization="none")
    assert make_engine(path, dtype="bfloat16").weights.quantization is None  # the default dequantizes (opt-in)
    assert q.weights.quantization.startswith("gguf (Q4_0")
    assert d.weights.quantization is None
    assert q.weights.weight_bytes < 0.4 * d.weights.weight_bytes  # ~4.5 bits a weight against 16
    res = q.generate(case.prompts, params)
    assert all(len(r.token_ids) == m for r, m in zip(res, case.max_tokens, strict=True))


def test_requests_that_cannot_be_served_quantized_are_refused(build_model, gguf_dir):
    path = gguf_path(build_model, gguf_dir, "tiny-llama", "Q4_1")
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF file"):
        make_engine(build_model("tiny-llama"), quantization="gguf")
    with pytest.raises(ValueError, match="deterministic does not take GGUF quantized weights"):
        make_engine(path, deterministic=True, dtype="bfloat16", quantization="gguf")
    f16_path = gguf_path(build_model, gguf_dir, "tiny-llama", "F16")
    with pytest.raises(ValueError, match="holds no Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrix"):
        make_engine(f16_path, quantization="gguf")
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        make_engine(path, quantization="gguf", gguf_activations="int4")
    make_engine(path, deterministic=True, dtype="bfloat16", quantization="none")  # dequantized: served


def test_lora_and_ngram_speculation_run_on_the_quantized_base(build_model, gguf_dir, tmp_path):
    """LoRA adds its delta to the block linears' output, speculation verifies with them: greedy tokens
    equal to the dequantized base's under the same adapters (float32), and the adapter matters."""
    from engine.config.lora import LoraConfig
    from engine.config.speculative import SpeculativeConfig

    from .lora_helpers import SPECS, make_adapter

    path = gguf_path(build_model, gguf_dir, "tiny-llama", "Q8_0")
    adapter = make_adapter(build_model("tiny-llama"), tmp_path / "all", SPECS["all"])
    lora = LoraConfig(max_loras=2, max_lora_rank=16, modules=(("all", str(adapter)),))
    case = small_case(seed=7)
    jobs = [(p, m, n) for p, m in zip(case.prompts, case.max_tokens, strict=True) for n in (None, "all")]
    params = [greedy(m, lora_name=n) for _, m, n in jobs]

    def tokens(engine) -> list[list[int]]:
        return [r.token_ids for r in engine.generate([p for p, _, _ in jobs], params)]

    ref = tokens(make_engine(path, quantization="none", lora=lora))
    got = tokens(make_engine(path, lora=lora, quantization="gguf", gguf_activations="float"))
    assert mismatches(got, ref) == []
    assert [t for t, j in zip(ref, jobs, strict=True) if j[2]] != [t for t, j in zip(ref, jobs, strict=True) if not j[2]]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    plain = [r.token_ids for r in make_engine(path, quantization="gguf").generate(case.prompts,
                                                                                 [greedy(m) for m in case.max_tokens])]
    drafted = make_engine(path, speculative=spec, quantization="gguf").generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in drafted], plain) == []


TIE = 0.25  # nats: the int8 activations' largest logprob gap measured on these models is 0.14


@pytest.mark.parametrize(("preset", "qtype"), [("tiny-llama", "Q4_1"), ("tiny-llama-k", "MIX")],
                         ids=["tiny-llama-Q4_1", "tiny-llama-k-MIX"])
def test_int8_activations_follow_the_dequantized_model_up_to_near_ties(build_model, gguf_dir, preset, qtype):
    """int8 activations (per 32 values) everywhere: the engine names them and every block linear takes
    ggml_gemv_q8 (prefill included: cpu_gemv="on"). Against the dequantized float32 engine, per prompt
    and while the two agree: the chosen token's logprob within TIE of the reference's; where they first
    part, the int8 engine's token is among the reference's top 5 within TIE of its best (a near tie). The seeded models' logits are close together (ties within 0.01 nats
    occur), so later tokens may part, as llama.cpp's do from a float reference; 20+ steps agree in all."""
    path = gguf_path(build_model, gguf_dir, preset, qtype)
    case = small_case(seed=8)
    params = [greedy(m, logprobs=5) for m in case.max_tokens]
    ref = make_engine(path, quantization="none").generate(case.prompts, params)
    engine = make_engine(path, cpu_gemv="on", quantization="gguf", gguf_activations="int8")
    assert engine.weights.quantization.endswith("; int8 activations")
    assert all(lin.activations == "int8" and lin._op == torch.ops.tokenmill.ggml_gemv_q8 for lin in _linears(engine))
    agreed = 0
    for got, want in zip(engine.generate(case.prompts, params), ref, strict=True):
        for token, mine, theirs in zip(got.token_ids, got.logprobs, want.logprobs, strict=True):
            if token != theirs.token_id:
                top = dict(theirs.top)
                assert token in top and theirs.top[0][1] - top[token] <= TIE
                break
            assert abs(mine.logprob - theirs.logprob) <= TIE
            agreed += 1
    assert agreed >= 20


def test_mixed_activations_are_the_default_and_keep_the_down_projection_float(build_model, gguf_dir):
    """The default ("mixed"): int8 for every block linear but each MLP's down projection, which takes
    float32 activations (ggml_gemv); named on the engine-ready line's quantization text."""
    path = gguf_path(build_model, gguf_dir, "tiny-llama", "Q4_1")
    engine = make_engine(path, cpu_gemv="on", quantization="gguf")
    assert engine.weights.quantization.endswith("; mixed activations (int8, float for the MLP down projection)")
    model = engine.runner.model
    down = {id(layer.mlp.down_proj) for layer in model.model.layers}
    linears = _linears(engine)
    assert len(down) == len(model.model.layers) and down <= {id(lin) for lin in linears}
    for lin in linears:
        want = ("float", torch.ops.tokenmill.ggml_gemv) if id(lin) in down else ("int8", torch.ops.tokenmill.ggml_gemv_q8)
        assert (lin.activations, lin._op) == want
    case = small_case(seed=9)
    res = engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert [len(r.token_ids) for r in res] == case.max_tokens


def test_large_batches_multiply_the_dequantized_weight_in_float32_without_bf16_instructions(build_model, gguf_dir,
                                                                                          monkeypatch):
    """Above a linear's kernel rows, bf16 activations are multiplied in float32 by the weight dequantized
    to float32 where the CPU has no bf16 instructions (PyTorch's bf16 products are slow there), and
    rounded once to bf16; with them, in bf16."""
    from engine.models import gguf_linear

    path = gguf_path(build_model, gguf_dir, "tiny-llama", "Q4_1")
    lin = make_engine(path, dtype="bfloat16", quantization="gguf").runner.model.model.layers[0].self_attn.o_proj
    x = torch.randn(40, lin.in_features).bfloat16()
    w = lin.weight_q.dequantize(torch.float32)
    monkeypatch.setattr(gguf_linear, "cpu_has_bf16", lambda: False)
    assert torch.equal(lin._dequantized_linear(x), torch.nn.functional.linear(x.float(), w).bfloat16())
    monkeypatch.setattr(gguf_linear, "cpu_has_bf16", lambda: True)
    assert torch.equal(lin._dequantized_linear(x), torch.nn.functional.linear(x, w.bfloat16()))
