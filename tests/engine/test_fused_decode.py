"""The C++ layer loop of decode-only CPU steps (engine/kernels/csrc/cpu_decode.cpp, models/fused_decode.py)
against the Python layers it replaces: the same tokens and bit-identical log-probabilities for every
model family, in float32 and bf16, with every kind of linear it calls (plain, oneDNN-packed, the
small-batch gemv kernels, INT8, GGUF blocks with float and int8 activations), at batch sizes that switch
between them; and it really runs."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.api import SamplingParams
from engine.models import cpu_linear
from engine.models.fused_decode import FusedDecode
from engine.models.gguf_linear import GGMLLinear, GGMLStack

from .gguf_helpers import gguf_path
from .helpers import (
    FAMILY_PRESETS,
    MOE_PRESETS,
    TINY_PRESETS,
    WINDOW_PRESETS,
    make_case,
    make_engine,
    require_cpu_kernels,
)

require_cpu_kernels()

# Gemma 2/3 run the loop with their own layer shape (fused_decode.py `gemma`): (1 + weight) norms around
# attention and the MLP, GeGLU, Gemma 2's attention soft-cap, Gemma 3's Q/K norms and local RoPE tables.
GEMMA_PRESETS = ["tiny-gemma2", "tiny-gemma3"]

# (dtype, engine overrides): each linear kind the plan can pick at some row count.
VARIANTS = {
    "f32-plain": ("float32", {"cpu_gemv": "off"}),
    "f32-gemv": ("float32", {"cpu_gemv": "on"}),
    "f32-auto": ("float32", {}),
    "bf16-packed": ("bfloat16", {"cpu_gemv": "off"}),
    "bf16-gemv": ("bfloat16", {"cpu_gemv": "on"}),
    "int8": ("float32", {"quantization": "int8", "cpu_gemv": "on"}),
}


def _run(path, fused: bool, dtype: str, overrides: dict, case):
    engine = make_engine(path, dtype=dtype, fused_decode=fused, **overrides)
    model = engine.runner.model.model
    assert (model.fused_decode is not None) == fused
    taken = []
    if fused:  # count the steps the C++ loop took (it declines prefills and steps it has no plan for)
        run = model.fused_decode.run

        def counted(x, ctx):
            out = run(x, ctx)
            taken.append(out is not None)
            return out

        model.fused_decode.run = counted
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in case.max_tokens]
    results = engine.generate(case.prompts, params)
    tokens = [r.token_ids for r in results]
    logprobs = [[(lp.logprob, lp.top) for lp in r.logprobs] for r in results]
    return tokens, logprobs, sum(taken)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("preset", TINY_PRESETS + WINDOW_PRESETS + GEMMA_PRESETS)
def test_fused_decode_matches_the_python_layers(build_model, preset, variant):
    if variant == "int8" and cpu_linear.kernels_unavailable("int8") is not None:
        # the C++ loop runs INT8 linears only on the small-batch kernels (AVX-512 VNNI); without them the
        # engine keeps its Python layers (tests/engine/test_cpu_linear.py covers that fallback)
        pytest.skip(f"INT8 kernels unavailable here: {cpu_linear.kernels_unavailable('int8')}")
    path = build_model(preset)
    dtype, overrides = VARIANTS[variant]
    case = make_case(vocab=256, n=7, seed=3)
    case.max_tokens = [12, 3, 9, 12, 1, 7, 12]  # the batch shrinks as requests end: row counts 7..1
    want_tokens, want_lps, _ = _run(path, False, dtype, overrides, case)
    got_tokens, got_lps, fused_steps = _run(path, True, dtype, overrides, case)
    assert got_tokens == want_tokens
    assert got_lps == want_lps  # bit for bit: the same kernels in the same order
    assert fused_steps >= 8  # most decode steps went through the C++ loop


# GGUF files whose matrices stay as blocks (quantization="gguf"): (preset, type, dtype, activations). The
# mix's q/k/v shards hold two types (a stack: several calls), so its steps keep the Python layers.
GGUF_CASES = [("tiny-llama", "Q4_1", "bfloat16", "int8"), ("tiny-llama", "Q8_0", "float32", "float"),
              ("tiny-llama", "Q5_0", "bfloat16", "float"), ("tiny-llama-k", "Q4_K", "float32", "int8"),
              ("tiny-llama-k", "Q6_K", "bfloat16", "int8"), ("tiny-gemma3", "Q8_0", "bfloat16", "int8"),
              ("tiny-gemma2", "Q8_0", "float32", "float"), ("tiny-llama", "Q4_0", "bfloat16", "mixed")]  # fmt: skip


@pytest.mark.parametrize(("preset", "qtype", "dtype", "activations"), GGUF_CASES,
                         ids=["-".join(c) for c in GGUF_CASES])
def test_fused_decode_runs_gguf_blocks_as_the_python_layers(build_model, tmp_path_factory, preset, qtype, dtype,
                                                            activations):
    path = gguf_path(build_model, tmp_path_factory.mktemp("gguf-fused"), preset, qtype)
    overrides = {"quantization": "gguf", "gguf_activations": activations, "cpu_gemv": "on"}
    case = make_case(vocab=256, n=7, seed=5)
    case.max_tokens = [12, 3, 9, 12, 1, 7, 12]
    want_tokens, want_lps, _ = _run(path, False, dtype, overrides, case)
    got_tokens, got_lps, fused_steps = _run(path, True, dtype, overrides, case)
    assert got_tokens == want_tokens
    assert got_lps == want_lps  # bit for bit: the same block kernels in the same order
    assert fused_steps >= 8


def test_gguf_weights_of_several_types_keep_the_python_layers(build_model, tmp_path_factory):
    path = gguf_path(build_model, tmp_path_factory.mktemp("gguf-mix"), "tiny-llama", "MIX")
    engine = make_engine(path, quantization="gguf", fused_decode=True, cpu_gemv="on")
    assert any(isinstance(m, GGMLLinear) and isinstance(m.weight_q, GGMLStack) for m in engine.runner.model.modules())
    model = engine.runner.model.model
    taken = []
    run = model.fused_decode.run
    model.fused_decode.run = lambda x, ctx: taken.append(run(x, ctx)) or taken[-1]
    engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert taken and all(out is None for out in taken)  # declined: the stack is two calls


def test_fused_decode_can_be_turned_off():
    with pytest.raises(ValueError, match="fused_decode must be a bool"):
        EngineConfig(model="x", fused_decode="yes")  # type: ignore[arg-type]
    assert FusedDecode.available()


@pytest.mark.parametrize("preset", [p for p in FAMILY_PRESETS if p not in GEMMA_PRESETS] + MOE_PRESETS)
def test_models_the_loop_does_not_implement_keep_the_python_layers(build_model, preset, caplog):
    """OLMo 2's post-norms, Granite's residual multiplier, SmolLM3's NoPE layers, Phi-4-mini's partial
    rotary, the mixture-of-experts MLPs: the C++ loop does none of them, so the model declines it (a log
    line says why) and its decode steps run the Python layers (the parity suite checks their tokens against transformers)."""
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        engine = make_engine(build_model(preset), fused_decode=True)
    model = engine.runner.model
    assert model.model.fused_decode is None
    assert model.fused_decode_unsupported() is not None
    assert any("fused decode: off for" in r.getMessage() for r in caplog.records)


def test_phi3_with_full_rotary_takes_the_loop(build_model, tmp_path):
    """Phi-3-mini rotates whole heads: Llama's math, so the C++ loop runs it, with the same tokens."""
    import json
    import shutil

    path = tmp_path / "phi3-full-rotary"
    shutil.copytree(build_model("tiny-phi3"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("partial_rotary_factor", None)
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    (path / "config.json").write_text(json.dumps(cfg))
    case = make_case(vocab=256, n=5, seed=4)
    case.max_tokens = [8, 3, 8, 1, 6]
    want_tokens, want_lps, _ = _run(path, False, "float32", {}, case)
    got_tokens, got_lps, fused_steps = _run(path, True, "float32", {}, case)
    assert got_tokens == want_tokens and got_lps == want_lps
    assert fused_steps >= 4


@pytest.mark.parametrize("preset", GEMMA_PRESETS)
def test_gemma_takes_the_loop_and_says_so(build_model, preset, caplog):
    """Gemma's layers are the loop's: the model does not decline it, and the start-up log names the path."""
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        engine = make_engine(build_model(preset), fused_decode=True)
    model = engine.runner.model
    assert model.fused_decode_unsupported() is None
    assert model.model.fused_decode is not None and model.model.fused_decode.gemma
    assert any("fused decode: on for Gemma" in r.getMessage() for r in caplog.records)


def test_a_declined_loop_is_an_error_when_kernels_are_required(build_model, monkeypatch):
    """TOKENMILL_REQUIRE_KERNELS=1: a model the loop implements that cannot have it (its kernels missing)
    stops the start instead of running the Python layers; without the variable it falls back."""
    from engine.kernels.cpu_kernels import KernelsUnavailable

    path = build_model("tiny-gemma3")
    monkeypatch.setattr(FusedDecode, "available", staticmethod(lambda: False))
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "1")
    with pytest.raises(KernelsUnavailable, match="fused decode unavailable for Gemma3ForCausalLM"):
        make_engine(path, fused_decode=True)
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "0")
    assert make_engine(path, fused_decode=True).runner.model.model.fused_decode is None
