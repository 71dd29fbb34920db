"""Decode step vs its floors: how close one engine decode step gets to the time of its matrix
multiplications alone (the same weights, the same batch), and to the time it takes this machine
just to read those weights from memory, measured in the same process.

    python -m bench floor --model smollm2-135m-instruct --batch 1 32 --context 256 --threads 2 [--quantization int8]

The matmul floor is every linear layer of the model (fused QKV, O, fused gate/up, down, lm_head)
applied once to a [batch, in_features] input, back to back, through the modules and calls the engine
makes (a gate/up whose kernel fuses silu(gate) * up is timed with it): the arithmetic and weight
traffic a decode step cannot avoid. A second figure adds the attention's own products (q k^T and
p v on contiguous K/V of the step's shapes), also matrix multiplications of the step. Gathers,
softmax, norms, rotary, sampling and scheduling are what the step adds on top.

The bandwidth floor is the bytes of those weights in the served precision (bf16, or INT8 and its
scales) over the read bandwidth measured here: a C++ loop summing a buffer as large as the weights
(at least 64 MiB) on the same threads, so cache effects at that size count as they do for the step.
At small batches a decode step cannot beat it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench.lib.workloads import DEFAULT_MODEL
from engine import Engine, EngineConfig, SamplingParams
from engine.kernels import cpu_kernels
from engine.models.cpu_linear import GemvF32Linear, GemvLinear, Int8Linear
from engine.models.packed_linear import PackedLinear


@dataclass
class FloorResult:
    batch: int
    context: int
    step_ms: float  # median wall time of one decode step (engine.step())
    floor_ms: float  # median wall time of the step's linear layers alone
    ratio: float  # step_ms / floor_ms
    attn_ms: float  # median wall time of the attention products alone (q k^T and p v, contiguous K/V)
    ratio_with_attn: float  # step_ms / (floor_ms + attn_ms)
    weight_bytes: int  # bytes of the linear weights one step reads (served precision)
    read_gbps: float  # median read bandwidth over a buffer of max(weight_bytes, 64 MiB), GB/s
    bandwidth_floor_ms: float  # weight_bytes / read bandwidth
    ratio_bandwidth: float  # step_ms / bandwidth_floor_ms
    step_runs_ms: list[float]
    floor_runs_ms: list[float]


def decode_engine(model: str, dtype: str, batch: int, context: int, max_tokens: int, pack: bool = True,
                  quantization: str | None = None, cpu_gemv: str = "auto") -> Engine:
    """An engine with `batch` requests whose prompts are prefilled: every later step is a decode."""
    engine = Engine(EngineConfig(
        model=model, dtype=dtype, device="cpu", max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
        num_kv_blocks=batch * (-(-(context + max_tokens) // 16)) + 8, enable_prefix_caching=False,
        show_progress=False, pack_weights=pack, quantization=quantization, cpu_gemv=cpu_gemv,
    ))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(100 + 7 * i + 13 * j) % 1000 + 10 for j in range(context)]
        engine.add_request(f"floor-{i}", prompt_token_ids=prompt, params=params)
    while engine.stats().waiting or engine.stats().last_step_prefill_tokens or not engine.stats().steps:
        engine.step()
    return engine


def time_steps(engine: Engine, repeats: int) -> list[float]:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = engine.step()
        runs.append((time.perf_counter() - t) * 1e3)
        if engine.stats().last_step_prefill_tokens or not outs:
            raise RuntimeError("a timed step was not a pure decode step: raise max_tokens")
    return runs


@torch.inference_mode()
def time_matmuls(model: torch.nn.Module, batch: int, repeats: int) -> list[float]:
    """The decode step's linear layers alone, on [batch, in] inputs of the model's dtype, through
    the same modules the engine calls (oneDNN-packed ones when the engine packed its weights)."""
    linears = step_linears(model)
    dtype = model.model.norm.weight.dtype
    hidden = model.config.hidden_size

    def in_features(m) -> int:
        return getattr(getattr(m, "__self__", m), "in_features", hidden)

    inputs = {in_features(m): torch.randn(batch, in_features(m), dtype=dtype) for m in linears}
    for m in linears:  # warm-up
        m(inputs[in_features(m)])
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for m in linears:
            m(inputs[in_features(m)])
        runs.append((time.perf_counter() - t) * 1e3)
    return runs


@torch.inference_mode()
def time_attention_products(model: torch.nn.Module, batch: int, context: int, repeats: int) -> list[float]:
    """The attention's own matrix products, every layer, on the decode shapes: scores = q k^T
    ([batch * kv_heads, group, head_dim] x [.., head_dim, context]) and out = p v, with K/V already
    contiguous (what a kernel reading the paged cache in place could not beat)."""
    cfg = model.config
    heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = model.model.norm.weight.dtype
    q = torch.randn(batch * kvh, heads // kvh, d, dtype=dtype)
    k = torch.randn(batch * kvh, context, d, dtype=dtype)
    v = torch.randn(batch * kvh, context, d, dtype=dtype)
    p = torch.softmax(torch.randn(batch * kvh, heads // kvh, context), -1).to(dtype)
    layers = cfg.num_hidden_layers
    torch.bmm(torch.bmm(q, k.transpose(1, 2)), v)  # warm-up
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(layers):
            torch.bmm(q, k.transpose(1, 2))
            torch.bmm(p, v)
        runs.append((time.perf_counter() - t) * 1e3)
    return runs


def step_linears(model: torch.nn.Module) -> list:
    """The linear products of a decode step, each once, as the engine calls them: a fused gate/up's
    silu_mul, a GemvLinear (not the oneDNN copy inside it), the logits head (compute_logits when a
    tied head is the embedding itself); not an untied INT8 embedding's lookup rows."""
    kinds = (torch.nn.Linear, PackedLinear, GemvLinear, GemvF32Linear, Int8Linear)
    inner = {id(m.large) for m in model.modules() if isinstance(m, GemvLinear)}
    mods = [m for m in model.modules() if isinstance(m, kinds) and id(m) not in inner and not _lookup_only(model, m)]
    fused = {id(mlp.gate_up_proj) for mlp in model.modules() if getattr(mlp, "fused_act", False)}
    calls = [m.silu_mul if id(m) in fused else m for m in mods]
    if model.lm_head is None:  # tied and unpacked: the logits multiply by the embedding matrix
        calls.append(model.compute_logits)
    return calls


def _lookup_only(model: torch.nn.Module, m: torch.nn.Module) -> bool:
    """An untied INT8 embedding's rows: looked up, never multiplied."""
    source = getattr(model.model.embed_tokens, "source", None)
    return m is source and source is not model.lm_head


def read_buffer(weight_bytes: int) -> torch.Tensor:
    """The buffer the read bandwidth is measured on: as large as the weights, at least 64 MiB."""
    return torch.ones(max(weight_bytes, 64 << 20) // 8, dtype=torch.int64)


def time_read(buf: torch.Tensor) -> float:
    """Seconds to read every byte of buf once (the C++ probe; torch's sum without the kernels)."""
    t = time.perf_counter()
    if cpu_kernels.load("linear") is None:
        torch.ops.tokenmill.read_sum(buf)
    else:
        buf.sum()
    return time.perf_counter() - t


def compile_elementwise(model: torch.nn.Module) -> None:
    """torch.compile (inductor, dynamic shapes) the RMSNorms and gated MLPs: the fusable elementwise
    work around the matmuls. An experiment switch, measured in docs/benchmarks/log.md."""
    from engine.models.layers import GatedMLP, RMSNorm

    for mod in model.modules():
        if isinstance(mod, (RMSNorm, GatedMLP)):
            mod.forward = torch.compile(mod.forward, dynamic=True)


def measure(model: str, dtype: str, batch: int, context: int, repeats: int, compile_: bool = False,
            pack: bool = True, quantization: str | None = None, cpu_gemv: str = "auto") -> FloorResult:
    engine = decode_engine(model, dtype, batch, context, repeats + 8, pack, quantization, cpu_gemv)
    if compile_:
        compile_elementwise(engine.runner.model)
    time_steps(engine, 2)  # warm-up (and compilation)
    weight_bytes = engine.weights.weight_bytes
    buf = read_buffer(weight_bytes)
    time_read(buf)
    # Interleave the measurements so drifts in the machine's load hit all alike.
    step, floor, attn, read = [], [], [], []
    bs = engine.block_size
    padded = -(-(context + repeats // 2) // bs) * bs  # mid-run context, whole blocks as the engine reads
    for _ in range(repeats):
        step += time_steps(engine, 1)
        floor += time_matmuls(engine.runner.model, batch, 1)
        attn += time_attention_products(engine.runner.model, batch, padded, 1)
        read.append(buf.numel() * 8 / time_read(buf) / 1e9)
    s, f, a, gbps = statistics.median(step), statistics.median(floor), statistics.median(attn), statistics.median(read)
    bw = weight_bytes / (gbps * 1e9) * 1e3
    return FloorResult(batch, context, s, f, s / f, a, s / (f + a), weight_bytes, gbps, bw, s / bw, step, floor)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("floor", help="decode step time vs its matmul floor",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder, smollm2-135m-instruct or a make_model preset (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the norms and MLPs first (experiment)")
    p.add_argument("--no-pack", action="store_true", help="plain F.linear weights (EngineConfig.pack_weights=False)")
    p.add_argument("--quantization", default=None, choices=("int8",), help="INT8 weight-only linears")
    p.add_argument("--cpu-gemv", default="auto", choices=("auto", "on", "off"), help="small-batch linear kernels")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.lib.workloads import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(resolve_model(args.model))
    results = [measure(model, args.dtype, b, args.context, args.repeats, args.compile, not args.no_pack,
                       args.quantization, args.cpu_gemv) for b in args.batch]
    print(f"{args.command_line}\n{'batch':>6} {'context':>8} {'step ms':>9} {'floor ms':>9} {'ratio':>6}"
          f" {'attn mm ms':>11} {'ratio w/ attn':>14} {'weight MB':>10} {'read GB/s':>10} {'bw floor ms':>12}"
          f" {'step/bw':>8}")
    for r in results:
        print(f"{r.batch:>6} {r.context:>8} {r.step_ms:>9.2f} {r.floor_ms:>9.2f} {r.ratio:>6.2f}"
              f" {r.attn_ms:>11.2f} {r.ratio_with_attn:>14.2f} {r.weight_bytes / 1e6:>10.1f} {r.read_gbps:>10.1f}"
              f" {r.bandwidth_floor_ms:>12.2f} {r.ratio_bandwidth:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0
