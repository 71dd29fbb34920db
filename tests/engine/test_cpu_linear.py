"""The CPU linear modules on the small-batch kernels (engine/models/cpu_linear.py) and their start-up
choice (engine/weights/cpu_weights.py): routing by row count, the measured plan, INT8 end to end on tiny
models (tokens, half the weight bytes), the engine with the kernels on vs off, and every fallback
(kernels off, no compiler, a CPU without the instructions) with its log line."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, SamplingParams
from engine.models import cpu_linear
from engine.models.cpu_linear import GemvLinear, Int8Embedding, Int8Linear, measure_max_rows
from engine.models.layers import GatedMLP
from engine.models.packed_linear import PackedLinear, packing_supported
from engine.models.quantization import quantize_int8
from engine.weights.cpu_weights import prepare_weights

from .helpers import make_case, make_engine, mismatches, require_cpu_kernels, run_all

require_cpu_kernels()

if cpu_linear.kernels_unavailable("int8") is not None:  # the fallback tests below need the kernels' absence faked
    pytest.skip(f"linear kernels unavailable here: {cpu_linear.kernels_unavailable('int8')}", allow_module_level=True)

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]  # untied, biased qkv, tied head
# oneDNN packs bf16 weights where the CPU has AVX-512 BW/VL/DQ (or AVX-NE-CONVERT); an AVX2-only CPU
# keeps the plain weight for F.linear above the kernel's rows
ONEDNN = packing_supported(torch.device("cpu"), torch.bfloat16)


# ---- modules -------------------------------------------------------------------------------------

def test_gemv_linear_routes_by_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    lin = GemvLinear(w, b, max_rows=4, batch_hint=8, onednn=ONEDNN)
    calls = []
    large = lin._large
    lin._large = lambda x: calls.append(1) or large(x)  # oneDNN's copy, or F.linear
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        want = x.double() @ w.double().T + b.double()
        assert float((lin(x).double() - want).norm() / want.norm()) < 4e-3
    assert len(calls) == 2  # 5 and 40 rows went to oneDNN, 1 and 4 to the kernel
    plain = GemvLinear(w, b, max_rows=0, batch_hint=8, onednn=False)
    assert plain.large is None and torch.equal(plain(x), F.linear(x, w, b))


def test_gemv_linear_silu_mul_both_paths():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 32, generator=g) / 6).bfloat16()
    lin = GemvLinear(w, None, max_rows=2, batch_hint=8, interleave=True, onednn=ONEDNN)
    for rows in (1, 2, 9):  # kernel, kernel, oneDNN (or F.linear) + PyTorch
        x = torch.randn(rows, 32, generator=g).bfloat16()
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        torch.testing.assert_close(lin.silu_mul(x), F.silu(gate) * up, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("group", [None, 16])
def test_int8_linear_kernel_and_fallback_agree(group):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(2 * 40, 64, generator=g), torch.randn(80, generator=g)
    q = quantize_int8(w, group)
    kernel = Int8Linear(q, b, max_rows=8, kernel=True, interleave=True)
    fallback = Int8Linear(q, b, max_rows=8, kernel=False, interleave=True)
    plain = Int8Linear(q, b, max_rows=8, kernel=True)
    assert not fallback.interleave and fallback.max_rows == 0
    assert torch.equal(kernel.dequantize(torch.float32), q.dequantize(torch.float32))  # interleaved layout undone
    for rows in (1, 8, 9, 100):  # 9 and 100: past max_rows, dequantized for PyTorch
        x = torch.randn(rows, 64, generator=g)
        h = x.double() @ q.dequantize(torch.float64).T + b.double()
        tol = 3e-4 * float(h.abs().max())  # the kernel rounds x to int16: 2^-16 of its largest element
        torch.testing.assert_close(plain(x).double(), h, rtol=0, atol=tol)
        torch.testing.assert_close(fallback(x).double(), h, rtol=0, atol=1e-4)
        want = F.silu(h[:, :40]) * h[:, 40:]
        torch.testing.assert_close(kernel.silu_mul(x).double(), want, rtol=0, atol=tol * float(h.abs().max()))
        torch.testing.assert_close(fallback.silu_mul(x).double(), want, rtol=1e-4, atol=1e-4)
    # what is stored (and read): the packed layout pads rows to whole blocks of 16 x 4
    assert kernel.weight_bytes == kernel.q.numel() + kernel.scales.numel() * 4 >= q.nbytes
    assert fallback.weight_bytes == q.nbytes


@pytest.mark.parametrize("kernel", [True, False])
def test_int8_embedding_rows(kernel):
    g = torch.Generator().manual_seed(3)
    q = quantize_int8(torch.randn(37, 24, generator=g), 8)
    head = Int8Linear(q, None, max_rows=4, kernel=kernel)
    emb = Int8Embedding(head, torch.bfloat16)
    ids = torch.tensor([[0, 36, 17], [16, 15, 0]])
    want = q.dequantize(torch.float32)[ids].bfloat16()
    assert torch.equal(emb(ids), want) and emb(ids).shape == (2, 3, 24)


def test_measure_max_rows_finds_the_crossover():
    def sleeper(per_row_s: float, fixed_s: float):
        def fn(x):
            import time
            time.sleep(fixed_s + per_row_s * x.shape[0])
        return fn

    fast_small = sleeper(2e-4, 0.0)  # 0.2 ms a row
    flat = sleeper(0.0, 1.5e-3)  # 1.5 ms whatever the rows
    assert measure_max_rows(fast_small, flat, 8, torch.float32, limit=64, reps=3) == 4  # 0.8 < 1.5 < 1.6 ms
    assert measure_max_rows(flat, fast_small, 8, torch.float32, limit=64, reps=3) == 0
    assert measure_max_rows(fast_small, flat, 8, torch.float32, limit=2, reps=3) == 2


# ---- start-up choice -------------------------------------------------------------------------------

def _weights(path, **kw):
    engine = make_engine(path, **kw)
    return engine, engine.runner.model


def test_bf16_on_uses_the_kernels_everywhere(build_model):
    engine, model = _weights(build_model("tiny-llama"), dtype="bfloat16", cpu_gemv="on")
    lins = [m for m in model.modules() if isinstance(m, GemvLinear)]
    assert len(lins) == 2 * 4 + 1 and all(m.max_rows == cpu_linear.ALWAYS for m in lins)  # 4 per layer + head
    assert all(m.fused_act for m in model.modules() if isinstance(m, GatedMLP))
    assert engine.weights.packed == ONEDNN and "all rows" in engine.weights.gemv
    _, plain = _weights(build_model("tiny-llama"), dtype="bfloat16", cpu_gemv="off")
    assert not any(isinstance(m, GemvLinear) for m in plain.modules())
    assert sum(isinstance(m, PackedLinear) for m in plain.modules()) == (9 if ONEDNN else 0)


def test_auto_measures_each_shape_once(build_model, monkeypatch):
    from engine.weights import cpu_weights
    seen = []
    monkeypatch.setattr(cpu_weights, "_measure", lambda lin, *a: seen.append((lin.out_features, lin.in_features, lin.interleave)) or 2)
    engine, model = _weights(build_model("tiny-qwen3"), dtype="bfloat16", max_num_seqs=8)
    assert len(seen) == len(set(seen)) >= 4  # qkv, o, gate/up, down, head: each shape once (2 layers share them)
    assert all(m.max_rows == 2 for m in model.modules() if isinstance(m, GemvLinear))
    monkeypatch.setattr(cpu_weights, "_measure", lambda lin, *a: 0)  # never faster: one layout only
    _, model = _weights(build_model("tiny-qwen3"), dtype="bfloat16")
    assert not any(isinstance(m, GemvLinear) for m in model.modules())
    assert not any(m.fused_act for m in model.modules() if isinstance(m, GatedMLP))


def test_float32_engine_is_untouched_by_the_bf16_kernels(build_model):
    path = build_model("tiny-llama")
    case = make_case(vocab=500, n=10, seed=4)
    on, off = make_engine(path, cpu_gemv="on"), make_engine(path, cpu_gemv="off")
    assert not any(isinstance(m, (GemvLinear, Int8Linear)) for m in on.runner.model.modules())
    assert run_all(on, case) == run_all(off, case)


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_kernels_pick_the_references_token_when_it_is_clear(build_model, preset):
    """bf16 sums in another order than oneDNN: where oneDNN's top token leads clearly, the kernel's
    engine picks it, and its logprob is within bf16 noise."""
    path = build_model(preset)
    case = make_case(vocab=500, n=16, seed=5)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
    ref = make_engine(path, dtype="bfloat16", cpu_gemv="off").generate(case.prompts, params)
    got = make_engine(path, dtype="bfloat16", cpu_gemv="on").generate(case.prompts, params)
    clear = 0
    for r, o in zip(ref, got, strict=True):
        (t1, lp1), (_, lp2) = r.logprobs[0].top[:2]
        if lp1 - lp2 > 0.1:
            clear += 1
            assert o.token_ids[0] == t1 and abs(o.logprobs[0].logprob - r.logprobs[0].logprob) < 0.1
    assert clear >= 4


@pytest.mark.parametrize("preset", PRESETS + ["tiny-mistral"])
def test_int8_kernels_on_vs_off_same_tokens_in_float32(build_model, preset):
    """Same INT8 weights, the kernel (int16 activations) vs dequantize + PyTorch: whole greedy outputs."""
    path = build_model(preset)
    case = make_case(vocab=500, n=16, seed=3)
    on = make_engine(path, quantization="int8", cpu_gemv="on")
    off = make_engine(path, quantization="int8", cpu_gemv="off")
    assert all(m.kernel for m in on.runner.model.modules() if isinstance(m, Int8Linear) and m is not _lookup(on))
    assert not any(m.kernel for m in off.runner.model.modules() if isinstance(m, Int8Linear))
    assert mismatches(run_all(on, case), run_all(off, case)) == []


def _lookup(engine):
    return getattr(engine.runner.model.model.embed_tokens, "source", None)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_end_to_end(build_model, preset, dtype):
    """INT8 weights: about half the bytes, no bf16/float32 linear left, the embedding looked up in
    INT8, and the float32 reference's first token wherever it leads clearly."""
    path = build_model(preset)
    case = make_case(vocab=500, n=16, seed=5)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
    ref_engine = make_engine(path, dtype=dtype, cpu_gemv="off")
    engine = make_engine(path, dtype=dtype, quantization="int8", cpu_gemv="on")  # "on": no start-up timing
    model = engine.runner.model
    assert engine.weights.quantization == "int8" and isinstance(model.model.embed_tokens, Int8Embedding)
    assert not any(isinstance(m, (torch.nn.Linear, PackedLinear, GemvLinear)) for m in model.modules())
    elem = 4 if dtype == "float32" else 2
    assert engine.weights.weight_bytes < ref_engine.weights.weight_bytes / elem * 1.1
    ref = make_engine(path).generate(case.prompts, params)  # float32, no quantization
    got = engine.generate(case.prompts, params)
    clear = 0
    for r, o in zip(ref, got, strict=True):
        (t1, lp1), (_, lp2) = r.logprobs[0].top[:2]
        if lp1 - lp2 > 0.3:  # INT8 moves these tiny random models' logprobs by up to ~0.2
            clear += 1
            assert o.token_ids[0] == t1 and abs(o.logprobs[0].logprob - r.logprobs[0].logprob) < 0.3
    assert clear >= 4


# ---- fallbacks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("why,fake", [
    ("no C++ compiler", {"load": lambda group: "no C++ compiler (g++ or c++) on PATH"}),
    ("this CPU lacks AVX2/FMA", {"cpu_supports": lambda kind: False}),
])
def test_no_kernels_fall_back_with_one_log_line(build_model, monkeypatch, caplog, why, fake):
    for name, fn in fake.items():
        if name == "load":
            monkeypatch.setattr(cpu_linear.cpu_kernels, "load", fn)
        else:
            monkeypatch.setattr(cpu_linear, name, fn)
    path = build_model("tiny-llama")
    case = make_case(vocab=500, n=6, seed=6)
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
        bf16 = make_engine(path, dtype="bfloat16", attention_backend="torch")
    lines = [r.getMessage() for r in caplog.records if "small-batch linear kernels unavailable" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0]
    assert why in bf16.weights.gemv and not any(isinstance(m, GemvLinear) for m in bf16.runner.model.modules())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
        int8 = make_engine(path, quantization="int8", attention_backend="torch")
    lines = [r.getMessage() for r in caplog.records if "INT8 kernels unavailable" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0]
    assert not any(m.kernel for m in int8.runner.model.modules() if isinstance(m, Int8Linear))
    monkeypatch.undo()
    kernel = make_engine(path, quantization="int8", cpu_gemv="on", attention_backend="torch")
    assert run_all(int8, case) == run_all(kernel, case)  # float32: the same tokens as the kernels'


def test_quantization_is_validated_and_cpu_only(build_model):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="cpu_gemv must be one of"):
        EngineConfig(model="m", cpu_gemv="yes")
    with pytest.raises(ValueError, match="quantization_group_size must be even"):
        EngineConfig(model="m", quantization="int8", quantization_group_size=33)
    with pytest.raises(ValueError, match="quantization_group_size must be a positive integer"):
        EngineConfig(model="m", quantization="int8", quantization_group_size=0)
    with pytest.raises(ValueError, match="CPU only"):
        prepare_weights(torch.nn.Module(), EngineConfig(model="m", quantization="int8"), torch.device("cuda"),
                        torch.bfloat16)
