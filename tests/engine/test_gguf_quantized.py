"""GGUF files served with their Q4_0 / Q4_1 / Q8_0 matrices kept quantized (opt-in on the CPU,
`quantization="gguf"`; engine/weights/gguf/blocks.py, engine/models/gguf_linear.py) against the same
file served dequantized (`quantization="none"`, the parity suite's engine, transformers-exact).

Both compute with the same weight values (the kernel decodes gguf's dequantized values bit for bit)
in float32; only the summation order differs (8-lane FMAs against MKL's), so greedy tokens are equal
for every prompt and every generated token (all of them: N = each prompt's max_tokens, 8 to 24),
served six prompts at once (batched decode, chunked prefill) and with prefill chunks above the
kernel's rows (the dequantize-per-call path)."""

from __future__ import annotations

import pytest
import torch

from engine.models.gguf_linear import GGMLEmbedding, GGMLLinear

from .gguf_helpers import gguf_path, small_case
from .helpers import greedy, make_engine, mismatches, require_cpu_kernels

require_cpu_kernels("ggml", "linear")

# (preset, type): the kernel types on tiny-llama (untied, Q/K rows permuted) and on tiny-llama-k (tied:
# the head and the embedding lookup share the blocks); a K-quant file (its Q4_K matrices dequantized).
FILES = [("tiny-llama", "Q8_0"), ("tiny-llama", "Q4_0"), ("tiny-llama", "Q4_1"), ("tiny-llama-k", "Q4_1"),
         ("tiny-llama-k", "Q4_K")]


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
    asked = None if qtype == "Q4_K" else "gguf"
    engine = make_engine(path, cpu_gemv=cpu_gemv, max_num_batched_tokens=64, quantization=asked)  # chunks of 64
    res = engine.generate(case.prompts, params)
    assert mismatches([r.token_ids for r in res], [r.token_ids for r in ref]) == []
    model = engine.runner.model
    if qtype == "Q4_K":  # no kernel type: everything dequantized, as before
        assert engine.weights.quantization is None and not _linears(engine)
        return
    assert engine.weights.quantization.startswith(f"gguf ({qtype}") or "Q8_0" in engine.weights.quantization
    layer = model.model.layers[0]
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
    k_path = gguf_path(build_model, gguf_dir, "tiny-llama-k", "Q4_K")
    with pytest.raises(ValueError, match="holds no Q4_0 / Q4_1 / Q8_0 matrix"):
        make_engine(k_path, quantization="gguf")
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
    got = tokens(make_engine(path, lora=lora, quantization="gguf"))
    assert mismatches(got, ref) == []
    assert [t for t, j in zip(ref, jobs, strict=True) if j[2]] != [t for t, j in zip(ref, jobs, strict=True) if not j[2]]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    plain = [r.token_ids for r in make_engine(path, quantization="gguf").generate(case.prompts,
                                                                                 [greedy(m) for m in case.max_tokens])]
    drafted = make_engine(path, speculative=spec, quantization="gguf").generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in drafted], plain) == []
