"""The Triton GGUF block kernels (engine/models/triton_ggml.py) against the gguf package, for every type
they take, run on the CPU by the Triton interpreter. Weights: random bytes with finite fp16 scales (every
bit pattern of the values and sub-scales occurs) and make_gguf.random_blocks (a quantized random matrix).

- ggml_dequantize_triton: bit-equal to gguf.quants.dequantize (float32), and to its values rounded once
  to bfloat16 (torch's round-to-nearest-even cast).
- ggml_gemv_triton: x W^T against float64 on the dequantized W. The kernel sums in another order than a
  float32 matmul (per unit of 32, then unit by unit), so the bound is the float32 one of any summation
  order, K * 2^-24 * sum_c |x_c w_c| (+ |b| 2^-24), asserted with a factor 2 of margin; bf16 x gives
  float32 x's result rounded once to nearest even (bit for bit). Odd shapes: N not a multiple of the row tile, M of
  1 to 9 (several x tiles, a partial one), leading dimensions kept.
Sizes are small: the interpreter runs each program in Python."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from engine.models import triton_ggml as TG  # noqa: E402
from engine.testing.make_gguf import random_blocks  # noqa: E402

if not TG.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
    TG = importlib.reload(TG)

ROOT = str(Path(__file__).resolve().parents[2])
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
IDS = [t.name for t in TYPES]
TILES = TG.GGMLTiles(block_n=8, block_m=4)  # small: several tiles of rows and of x, partial ones
HALVES = {Q.Q4_0: (0, 2), Q.Q4_1: (0, 4), Q.Q5_0: (0, 2), Q.Q5_1: (0, 4), Q.Q8_0: (0, 2),
          Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (208, 210)}  # fmt: skip  # byte range of fp16 scales


def _random_bytes(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks of random bytes whose fp16 scales are finite and small."""
    values, size = TG.BLOCKS[int(qtype)]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    lo, hi = HALVES[qtype]
    b[..., lo:hi] = rng.uniform(-0.01, 0.01, (n, k // values, (hi - lo) // 2)).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(b.reshape(n, -1))


def _k(qtype: Q) -> int:
    """Two blocks' worth of columns (K-quants: 512, others 64): both block indices and sub-units occur."""
    return 2 * TG.BLOCKS[int(qtype)][0]


def _weights(qtype: Q, n: int, seed: int) -> list[np.ndarray]:
    return [_random_bytes(qtype, n, _k(qtype), seed), random_blocks(qtype, n, _k(qtype), seed + 1)]


def test_kernels_run_under_the_interpreter():
    assert TG.INTERPRETED
    assert type(TG._gemv_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequantize_is_the_gguf_package_bit_for_bit(qtype):
    n, k = 11, _k(qtype)  # 11 rows: two row tiles of 8, the second partial
    for blocks in _weights(qtype, n, 3):
        want = torch.from_numpy(dequantize(blocks, qtype))  # [n, k] float32
        got = TG.ggml_dequantize_triton(torch.from_numpy(blocks), int(qtype), n, k, torch.float32, block_n=8)
        assert got.shape == (n, k) and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        got16 = TG.ggml_dequantize_triton(torch.from_numpy(blocks), int(qtype), n, k, torch.bfloat16, block_n=8)
        assert got16.dtype == torch.bfloat16
        assert torch.equal(got16.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


def test_bfloat16_rounding_is_to_nearest_even():
    # Q8_0 with d = 1 + 2^-8 (an fp16) and q = -16..15: d is halfway between two bf16 values (to even:
    # down), 3d = 3 + 3 / 256 lies above halfway (up); truncation would give 3
    d = np.array([1 + 2**-8], dtype=np.float16).view(np.uint8)
    block = np.zeros((1, 34), dtype=np.uint8)
    block[0, :2] = d
    block[0, 2:] = np.arange(32, dtype=np.int8).view(np.uint8) - 16
    want = torch.from_numpy(dequantize(block, Q.Q8_0)).to(torch.bfloat16)
    got = TG.ggml_dequantize_triton(torch.from_numpy(block), int(Q.Q8_0), 1, 32, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    truncated = (torch.from_numpy(dequantize(block, Q.Q8_0)).view(torch.int32) >> 16).to(torch.int16)
    assert (got.view(torch.int16) != truncated).any()  # some values rounded up, not truncated


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """2 * K * 2^-24 * sum_c |x_c w_c| (+ |b| 2^-24): [M, N]."""
    b = 0 if bias is None else bias.double().abs() * 2**-24
    return 2 * x.shape[-1] * 2**-24 * (x.double().abs() @ w.double().abs().t()) + b + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_gemv_equals_the_dequantized_product(qtype, rows):
    n, k = 13, _k(qtype)  # 13 rows: tiles of 8, one partial
    g = torch.Generator().manual_seed(rows)
    for i, blocks in enumerate(_weights(qtype, n, rows)):
        w = torch.from_numpy(dequantize(blocks, qtype))
        x = torch.randn(rows, k, generator=g)
        bias = torch.randn(n, generator=g) if i else None
        got = TG.ggml_gemv_triton(x, torch.from_numpy(blocks), int(qtype), n, k, bias, TILES)
        want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= _bound(x, w, bias)).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=["Q4_1", "Q6_K"])
def test_gemv_bfloat16_and_leading_dimensions(qtype):
    n, k = 10, _k(qtype)
    blocks = random_blocks(qtype, n, k, 7)
    w = torch.from_numpy(dequantize(blocks, qtype))
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = TG.ggml_gemv_triton(x, torch.from_numpy(blocks), int(qtype), n, k, None, TILES)
    assert got.shape == (2, 3, n) and got.dtype == torch.bfloat16
    # the float32 sums of the same (exactly widened) x, rounded once to nearest even
    full = TG.ggml_gemv_triton(x.float(), torch.from_numpy(blocks), int(qtype), n, k, None, TILES)
    assert torch.equal(got.view(torch.int16), full.to(torch.bfloat16).view(torch.int16))
    assert ((full.double() - x.double() @ w.double().t()).abs() <= _bound(x.reshape(-1, k), w, None).view(2, 3, n)).all()


def test_gemv_rows_are_independent_of_the_batch():
    # each output row is computed from its own x row: a row alone gives the same bits as in a batch
    qtype, n = Q.Q4_K, 9
    k = _k(qtype)
    blocks = torch.from_numpy(random_blocks(qtype, n, k, 1))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    both = TG.ggml_gemv_triton(x, blocks, int(qtype), n, k, None, TILES)
    alone = TG.ggml_gemv_triton(x[4:5], blocks, int(qtype), n, k, None, TILES)
    assert torch.equal(both[4:5], alone)


def test_refused_operands():
    blocks = torch.from_numpy(random_blocks(Q.Q4_0, 4, 64, 0))
    with pytest.raises(ValueError, match="no Triton kernel"):
        TG.ggml_gemv_triton(torch.zeros(1, 64), blocks, 1, 4, 64)
    with pytest.raises(ValueError, match="blocks must be"):
        TG.ggml_gemv_triton(torch.zeros(1, 64), blocks[:, :18], 2, 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        TG.ggml_gemv_triton(torch.zeros(1, 32), blocks, 2, 4, 64)
    with pytest.raises(ValueError, match="bias must be"):
        TG.ggml_gemv_triton(torch.zeros(1, 64), blocks, 2, 4, 64, torch.zeros(3))
    with pytest.raises(ValueError, match="dtype must be"):
        TG.ggml_dequantize_triton(blocks, 2, 4, 64, torch.float16)


# ---- the CUDA linear (engine/models/gguf_triton_linear.py), interpreted on CPU tensors ---------------


def test_linear_gemv_and_dequantized_paths_and_a_stack():
    from engine.models.gguf_linear import GGMLStack, GGMLWeight
    from engine.models.gguf_triton_linear import TritonGGMLLinear

    k = 256
    parts = (GGMLWeight(torch.from_numpy(random_blocks(Q.Q5_0, 5, k, 1)), int(Q.Q5_0), 5, k),
             GGMLWeight(torch.from_numpy(random_blocks(Q.Q6_K, 3, k, 2)), int(Q.Q6_K), 3, k))  # fmt: skip
    stack = GGMLStack(parts)
    w = stack.dequantize(torch.float32)  # [8, k] gguf's values
    bias = torch.randn(8, generator=torch.Generator().manual_seed(3))
    lin = TritonGGMLLinear(stack, bias, max_rows=2)
    g = torch.Generator().manual_seed(4)
    small, large = torch.randn(2, k, generator=g), torch.randn(5, k, generator=g)  # GEMV; dequantize + matmul
    got = lin(small)
    want = small.double() @ w.double().t() + bias.double()
    assert ((got.double() - want).abs() <= _bound(small, w, bias)).all()
    assert torch.equal(lin(large), torch.nn.functional.linear(large, w, bias))  # the same values, same matmul
    big16 = large.to(torch.bfloat16)
    assert torch.equal(lin(big16), torch.nn.functional.linear(big16, w.to(torch.bfloat16), bias.to(torch.bfloat16)))
    assert lin.weight_bytes == stack.nbytes
    with pytest.raises(ValueError, match="one type"):
        lin.rows(torch.tensor([0]), torch.float32)
    emb = TritonGGMLLinear(parts[1], None, 0)
    ids = torch.tensor([2, 0, 2])
    assert torch.equal(emb.rows(ids, torch.float32), parts[1].dequantize(torch.float32)[ids])


def test_engine_on_triton_block_linears_equals_dequantized(build_model, tmp_path, monkeypatch):
    # The real GGUF loading with quantization="gguf", the model's block linears built as on CUDA
    # (cpu_weights._ggml_triton, here on CPU tensors under the interpreter): greedy tokens equal the
    # dequantized float32 engine's for every generated token (N = 6 and 4); prefill chunks above
    # DEFAULT_MAX_ROWS take the dequantize kernel, decode the GEMV.
    from engine.models.gguf_linear import GGMLEmbedding
    from engine.models.gguf_triton_linear import TritonGGMLLinear
    from engine.weights import cpu_weights

    from .gguf_helpers import gguf_path
    from .helpers import greedy, make_engine

    path = gguf_path(build_model, tmp_path, "tiny-llama", "MIX")
    prompts, max_tokens = [[11, 52, 300, 7, 1000, 23, 99, 412, 5, 61, 17], [44, 9]], [6, 4]
    params = [greedy(m) for m in max_tokens]
    ref = make_engine(path, quantization="none").generate(prompts, params)
    monkeypatch.setattr(cpu_weights, "_ggml", lambda model, config, dtype, blocks, text:
                        cpu_weights._ggml_triton(model, torch.device("cpu"), dtype, blocks, text))  # fmt: skip
    engine = make_engine(path, quantization="gguf", fused_decode=False)
    assert engine.weights.quantization.endswith("; Triton")
    model = engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, TritonGGMLLinear)
    assert isinstance(model.lm_head, TritonGGMLLinear) and isinstance(model.model.embed_tokens, GGMLEmbedding)
    got = engine.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]


def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Everything the GPU would compile, compiled here (the interpreter does not compile): each type's
    GEMV (float32, bf16 x) and dequantize (float32, bf16) for sm_90, in a fresh process without
    TRITON_INTERPRET, through Triton's compiler and the ptxas in its wheel; no register spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    code = "from engine.models.triton_ggml import compile_all; print('\\n'.join(compile_all(90)))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("sm_90")]
    assert len(lines) == 4 * len(TG.BLOCKS) and all(" ok " in line for line in lines), run.stdout
    assert all("LOCAL:0" in line for line in lines if "LOCAL:" in line), run.stdout  # no spills


def test_gguf_on_cuda_without_triton_is_an_error_naming_why(build_model, tmp_path, monkeypatch):
    # blocks_for on a CUDA device asks the attention backend's Triton probe; where it says no, the
    # opt-in "gguf" is refused at start-up with the reason (no silent dequantized fallback)
    from engine import EngineConfig
    from engine.weights.gguf import blocks
    from engine.weights.model_open import open_model_source

    from .gguf_helpers import gguf_path

    path = str(gguf_path(build_model, tmp_path, "tiny-llama", "Q8_0"))
    source = open_model_source(path)
    cuda = torch.device("cuda")
    asked, default = EngineConfig(model=path, quantization="gguf"), EngineConfig(model=path)
    monkeypatch.setattr(blocks, "_triton_reason", lambda device: "no C compiler")
    with pytest.raises(ValueError, match=r"'gguf' on cuda needs the Triton kernels \(no C compiler\); use 'none'"):
        blocks.blocks_for(source, asked, cuda)
    assert blocks.blocks_for(source, default, cuda) is None  # the default dequantizes
    monkeypatch.setattr(blocks, "_triton_reason", lambda device: None)
    assert blocks.blocks_for(source, default, cuda) is None  # (opt-in even with Triton)
    plan = blocks.blocks_for(source, asked, cuda)
    assert plan is not None and plan.types == ["Q8_0"]
