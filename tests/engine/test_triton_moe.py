"""The Triton MoE grouped GEMMs (engine/models/triton_moe.py) against the dense per-token reference in
float64, run on the CPU by the Triton interpreter: random routing, experts with no token, every token
on one expert, top-1 to top-8, sizes that are not multiples of the tiles, float32 and bf16; the
alignment's layout; batch invariance; which path an engine's sparse layers take; and the whole engine
on the kernels against the PyTorch loop. TOKENMILL_TRITON_TEST_DEVICE=cuda runs the same tests on a GPU
without the interpreter (docs/GPU.md)."""

from __future__ import annotations

import importlib
import os

DEVICE = os.environ.get("TOKENMILL_TRITON_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.models import moe  # noqa: E402
from engine.models import triton_moe as TM  # noqa: E402
from engine.models.moe import dense_reference, route  # noqa: E402

if DEVICE == "cpu" and not TM.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
    TM = importlib.reload(TM)

from .helpers import greedy, make_case, make_engine  # noqa: E402

E, H, INTER = 6, 40, 24  # H and I not multiples of the tiles' 16: partial tiles on every side
TILES = TM.MoeTiles(block_m=16, block_n=16, block_k=16)  # small: several tiles of every kind
# ||got - want|| / ||want|| against float64 on the same (rounded) operands. bf16: h and the output are
# rounded to bf16 once each (2**-8 relative each); the interpreter truncates where the GPU rounds.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def _weights(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    down = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def _routed(tokens: int, top_k: int, normalize: bool, dtype: torch.dtype, seed: int):
    """x [T, H] in dtype, weights float32 [T, K], ids [T, K], on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(DEVICE, dtype)
    weights, ids = route(torch.randn(tokens, E, generator=g), top_k, normalize)
    return x, weights.to(DEVICE), ids.to(DEVICE)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.cpu().double() - want).norm() / want.norm()).item()


def _want(x, ids, weights, gate_up, down) -> torch.Tensor:
    """The float64 per-token reference on the CPU."""
    return dense_reference(x.cpu().double(), ids.cpu(), weights.cpu().double(), gate_up.cpu().double(),
                           down.cpu().double())


def test_kernels_run_under_the_interpreter():
    # The point of this module: on the CPU these are interpreter functions, so the kernels below really
    # run; on a GPU they are compiled
    assert TM.INTERPRETED == (DEVICE == "cpu")
    assert (type(TM._gate_up_kernel).__name__ == "InterpretedFunction") == (DEVICE == "cpu")


# ---- alignment ------------------------------------------------------------------------------------


def test_align_groups_pairs_by_expert_padded_per_block():
    ids = torch.tensor([[3, 0], [0, 3], [5, 0], [3, 1]])  # pairs 0..7; experts 2 and 4 receive none
    sorted_pairs, block_expert = TM.align(ids, E, 4)
    p = ids.numel()
    assert sorted_pairs.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert sorted_pairs.numel() == len(block_expert) * 4 >= p + E * 3
    blocks = sorted_pairs.view(-1, 4).tolist()
    # expert 0: pairs 1, 2, 5; expert 1: 7; expert 3: 0, 3, 6; expert 5: 4 (ascending pair within each)
    assert blocks[:4] == [[1, 2, 5, p], [7, p, p, p], [0, 3, 6, p], [4, p, p, p]]
    assert block_expert.tolist()[:4] == [0, 1, 3, 5]
    assert all(b == [p] * 4 for b in blocks[4:]) and all(e == -1 for e in block_expert.tolist()[4:])


def test_align_spills_a_large_expert_over_several_blocks():
    ids = torch.zeros(9, 1, dtype=torch.long)  # every token on expert 0
    sorted_pairs, block_expert = TM.align(ids, E, 4)
    assert sorted_pairs.tolist()[:12] == list(range(9)) + [9, 9, 9]
    assert block_expert.tolist()[:3] == [0, 0, 0] and set(block_expert.tolist()[3:]) == {-1}


# ---- the layer against the dense reference ---------------------------------------------------------


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 2), (7, 2), (33, 3), (20, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_the_dense_reference(tokens, top_k, dtype):
    gate_up, down = _weights(tokens, dtype)
    x, weights, ids = _routed(tokens, top_k, top_k > 1, dtype, 100 + tokens)
    got = TM.fused_experts(x, ids, weights, gate_up, down, TILES)
    assert got.shape == (tokens, H) and got.dtype == dtype
    assert _rel_err(got, _want(x, ids, weights, gate_up, down)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_token_on_one_expert_and_experts_without_tokens(dtype):
    gate_up, down = _weights(5, dtype)
    g = torch.Generator().manual_seed(5)
    tokens = 37  # three blocks of one expert, the last partial
    x = torch.randn(tokens, H, generator=g).to(DEVICE, dtype)
    ids = torch.full((tokens, 1), 4, dtype=torch.long, device=DEVICE)
    weights = torch.rand(tokens, 1, generator=g).to(DEVICE)
    got = TM.fused_experts(x, ids, weights, gate_up, down, TILES)
    assert _rel_err(got, _want(x, ids, weights, gate_up, down)) < TOL[dtype]
    # the other experts' weights are never read: NaN there changes nothing
    poisoned_gu, poisoned_down = gate_up.clone(), down.clone()
    keep = torch.arange(E, device=DEVICE) != 4
    poisoned_gu[keep], poisoned_down[keep] = float("nan"), float("nan")
    assert torch.equal(TM.fused_experts(x, ids, weights, poisoned_gu, poisoned_down, TILES), got)


def test_top_k_equal_to_the_expert_count():
    gate_up, down = _weights(8, torch.float32)
    x, weights, ids = _routed(5, E, False, torch.float32, 8)
    got = TM.fused_experts(x, ids, weights, gate_up, down, TILES)
    assert _rel_err(got, _want(x, ids, weights, gate_up, down)) < TOL[torch.float32]


def test_matches_the_pytorch_loop_on_a_block():
    # SparseMoeBlock's two paths on the same weights (float32: equal to rounding)
    block = moe.SparseMoeBlock(H, INTER, E, top_k=2, normalize=True)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    block.to(DEVICE)
    x = torch.randn(11, H, generator=g).to(DEVICE)
    want = block(x)
    block.experts.path = "triton"
    got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_its_batch(dtype):
    """Batch invariance: a token's row is bit-equal alone, beside others and at another place."""
    gate_up, down = _weights(9, dtype)
    g = torch.Generator().manual_seed(9)
    x, weights, ids = _routed(24, 2, True, dtype, 9)
    full = TM.fused_experts(x, ids, weights, gate_up, down, TILES)
    for t in (0, 13, 23):
        alone = TM.fused_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], gate_up, down, TILES)
        assert torch.equal(alone[0], full[t])
    perm = torch.randperm(24, generator=g).to(DEVICE)
    shuffled = TM.fused_experts(x[perm], ids[perm], weights[perm], gate_up, down, TILES)
    assert torch.equal(shuffled, full[perm])


def _gpt_oss_reference(x, ids, weights, gate_up, gu_bias, down, d_bias, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts arithmetic per token in float64 (gate and up interleaved, biases,
    the clamped SwiGLU), summed in ascending expert id."""
    x, gate_up, gu_bias, down, d_bias = (t.cpu().double() for t in (x, gate_up, gu_bias, down, d_bias))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            gu = gate_up[e] @ x[t] + gu_bias[e]  # [2I]
            gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += (down[e] @ h + d_bias[e]) * float(weights[t, j])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_and_gpt_oss_clamped_swiglu(dtype):
    gate_up, down = _weights(11, dtype)
    gate_up = gate_up * 8  # pre-activations past the clamp limit
    g = torch.Generator().manual_seed(11)
    gu_bias = torch.randn(E, 2 * INTER, generator=g).to(DEVICE, dtype)
    d_bias = torch.randn(E, H, generator=g).to(DEVICE, dtype)
    x, weights, ids = _routed(19, 2, False, dtype, 11)
    act = TM.ExpertAct(clamped=True, interleaved=True)
    # GPT-OSS's stacks are [E, H, 2I] and [E, I, H] (x @ W): passed as transposed views, read in place
    gu_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    assert gu_t.stride(1) == 1 and down_t.stride(1) == 1
    got = TM.fused_experts(x, ids, weights, gu_t, down_t, TILES, gate_up_bias=gu_bias, down_bias=d_bias, act=act)
    want = _gpt_oss_reference(x, ids, weights, gate_up, gu_bias, down, d_bias)
    assert (gate_up.cpu().double() @ x.cpu().double()[0]).abs().max() > 7  # the clamp is exercised
    assert _rel_err(got, want) < TOL[dtype]
    # biases on the default layout and activation: the loop's arithmetic plus the biases
    plain = TM.fused_experts(x, ids, weights, gate_up, down, TILES, gate_up_bias=gu_bias, down_bias=d_bias)
    gu64, b64, d64, db64 = (t.cpu().double() for t in (gate_up, gu_bias, down, d_bias))
    want = torch.zeros(19, H, dtype=torch.float64)
    for t in range(19):
        for j in sorted(range(2), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            gu = gu64[e] @ x.cpu().double()[t] + b64[e]
            h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            want[t] += (d64[e] @ h + db64[e]) * float(weights[t, j])
    assert _rel_err(plain, want) < TOL[dtype]
    with pytest.raises(ValueError, match="a bias must be"):
        TM.fused_experts(x, ids, weights, gate_up, down, TILES, down_bias=gu_bias)


def test_refuses_bad_operands():
    gate_up, down = _weights(1, torch.float32)
    x, weights, ids = _routed(3, 2, True, torch.float32, 1)
    if DEVICE == "cpu":  # on CUDA the check would wait for the device
        with pytest.raises(ValueError, match="expert ids"):
            TM.fused_experts(x, ids + E, weights, gate_up, down, TILES)
    with pytest.raises(ValueError, match="gate_up must be"):
        TM.fused_experts(x, ids, weights, gate_up[:, :, :-1], down, TILES)
    with pytest.raises(ValueError, match="dtype"):
        TM.fused_experts(x, ids, weights, gate_up.bfloat16(), down.bfloat16(), TILES)
    assert TM.fused_experts(x[:0], ids[:0], weights[:0], gate_up, down, TILES).shape == (0, H)


# ---- which path an engine takes ------------------------------------------------------------------


def test_cpu_engine_keeps_its_linears_and_never_takes_triton(build_model):
    engine = make_engine(build_model("tiny-qwen3-moe"))
    assert all(b.experts.path == "torch" for b in engine.runner.model.moe_blocks())
    plain = make_engine(build_model("tiny-qwen3-moe"), cpu_gemv="off")  # stacks kept, but on the CPU
    assert all(b.experts.path == "torch" for b in plain.runner.model.moe_blocks())
    assert moe.triton_experts_reason(torch.device("cpu")) is not None


def test_engine_on_triton_experts_matches_the_pytorch_loop(build_model, monkeypatch, caplog):
    """Greedy tokens through the whole engine (float32, batched, 8-token chunked prefill) with every
    sparse layer on the kernels (on the CPU: the probe answered as on a GPU) against the PyTorch loop."""
    path = build_model("tiny-qwen3-moe")
    case = make_case(vocab=2000, n=4, seed=3)
    params = [greedy(4) for _ in case.prompts]
    if DEVICE == "cpu":  # cpu_gemv off: the stacks are kept
        kw = dict(cpu_gemv="off", attention_backend="torch", max_num_batched_tokens=8)
    else:
        kw = dict(device=DEVICE, max_num_batched_tokens=8, num_kv_blocks=256)
    real_reason = moe.triton_experts_reason
    monkeypatch.setattr(moe, "triton_experts_reason", lambda device: "off for the reference")
    reference = make_engine(path, **kw)
    assert all(b.experts.path == "torch" for b in reference.runner.model.moe_blocks())
    want = [r.token_ids for r in reference.generate(case.prompts, params)]
    monkeypatch.setattr(moe, "triton_experts_reason", (lambda device: None) if DEVICE == "cpu" else real_reason)
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        engine = make_engine(path, **kw)
    assert "MoE experts: triton grouped GEMM" in caplog.text  # the start-up log names the path
    assert all(b.experts.path == "triton" for b in engine.runner.model.moe_blocks())
    calls = []
    real = TM.fused_experts
    monkeypatch.setattr(TM, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = [r.token_ids for r in engine.generate(case.prompts, params)]
    assert calls  # the kernels ran
    assert got == want


def test_require_kernels_turns_the_cuda_fallback_into_an_error(build_model, monkeypatch):
    from engine.weights.loader import load_model
    from engine.weights.model_open import open_model_source

    model = load_model(open_model_source(str(build_model("tiny-qwen3-moe"))), torch.float32, torch.device("cpu"),
                       64, False, frozenset())  # fmt: skip
    monkeypatch.setattr(moe, "triton_experts_reason", lambda device: "no compiler")
    cuda = torch.device("cuda")
    with pytest.raises(RuntimeError, match="TOKENMILL_REQUIRE_KERNELS=1: no compiler"):
        model.select_experts(cuda, torch.bfloat16, required=True)
    assert model.select_experts(cuda, torch.bfloat16, required=False) == "torch loop over experts (no compiler)"
    monkeypatch.setattr(moe, "triton_experts_reason", lambda device: None)
    assert model.select_experts(cuda, torch.bfloat16, required=True) == "triton grouped GEMM"
    assert all(b.experts.path == "triton" for b in model.moe_blocks())


# ---- what only a GPU would compile ------------------------------------------------------------------

_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.models import triton_moe as TM
assert not TM.INTERPRETED
t = TM.MoeTiles()
for ty in ("bf16", "fp32"):
    p = "*" + ty
    common = dict(BM=t.block_m, BN=t.block_n, BK=t.block_k, F32=ty == "fp32", ROWWISE=False)
    kernels = [
        (TM._gate_up_kernel, dict(x_ptr=p, w_ptr=p, bias_ptr=p, h_ptr=p, sorted_ptr="*i32",
                                  block_expert_ptr="*i32", stride_xt="i32", stride_we="i32", stride_wr="i32",
                                  stride_wk="i32", stride_ht="i32", stride_be="i32", alpha="fp32", limit="fp32"),
         dict(P=70, TOP_K=2, H=2048, INTER=768, ROW_STEP=1, UP_OFF=768, HAS_BIAS=False, CLAMPED=False, **common)),
        (TM._gate_up_kernel, dict(x_ptr=p, w_ptr=p, bias_ptr=p, h_ptr=p, sorted_ptr="*i32",
                                  block_expert_ptr="*i32", stride_xt="i32", stride_we="i32", stride_wr="i32",
                                  stride_wk="i32", stride_ht="i32", stride_be="i32", alpha="fp32", limit="fp32"),
         dict(P=70, TOP_K=4, H=2880, INTER=2880, ROW_STEP=2, UP_OFF=1, HAS_BIAS=True, CLAMPED=True, **common)),
        (TM._down_kernel, dict(h_ptr=p, w_ptr=p, bias_ptr=p, y_ptr="*fp32", route_ptr="*fp32", sorted_ptr="*i32",
                               block_expert_ptr="*i32", stride_ht="i32", stride_we="i32", stride_wr="i32",
                               stride_wk="i32", stride_yt="i32", stride_be="i32"),
         dict(P=70, H=2048, INTER=768, HAS_BIAS=True, **common)),
        (TM._sum_kernel, dict(y_ptr="*fp32", out_ptr=p, korder_ptr="*i32", stride_yt="i32", stride_ot="i32"),
         dict(TOP_K=2, H=2048, BN=t.block_n)),
    ]
    for kernel, types, consts in kernels:
        sig = {n: "constexpr" if n in consts else types[n] for n in kernel.arg_names}
        c = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert c.asm["cubin"], kernel.__name__
        print(kernel.__name__, ty, "ok")
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU run compiles them itself")
def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """The tl.dot paths the interpreter does not run, compiled for sm_90 (bf16 and float32) through
    Triton's compiler and the ptxas in its wheel, in a fresh process without TRITON_INTERPRET."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok") == 8


def test_a_block_with_its_own_arithmetic_keeps_the_loop(build_model, monkeypatch):
    from engine.weights.loader import load_model
    from engine.weights.model_open import open_model_source

    model = load_model(open_model_source(str(build_model("tiny-qwen3-moe"))), torch.float32, torch.device("cpu"),
                       64, False, frozenset())  # fmt: skip
    monkeypatch.setattr(moe, "triton_experts_reason", lambda device: None)
    block = model.moe_blocks()[0]
    block.__class__ = type("BiasedBlock", (moe.SparseMoeBlock,), {})  # as a GPT-OSS block would subclass it
    cuda = torch.device("cuda")
    assert model.select_experts(cuda, torch.bfloat16, required=True).endswith("(experts with their own arithmetic)")
    assert all(b.experts.path == "torch" for b in model.moe_blocks())
    block.__class__.triton_experts_supported = lambda self: True  # the subclass opts in
    assert model.select_experts(cuda, torch.bfloat16, required=True) == "triton grouped GEMM"
