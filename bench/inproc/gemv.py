"""The linear products of a model's decode step, one weight shape at a time: oneDNN's packed bf16
product (F.linear on a CPU where oneDNN does not pack bf16: AVX2 only) against this repository's
small-batch kernels (bf16, and INT8 weight-only, on this CPU's path), per row count.

    python -m bench gemv --model bench-135m --rows 1 2 4 8 16 32 --threads 2

Each shape is timed on `--layers` distinct random weights (so they do not all sit in cache, as the
real layers would not), every variant once per repeat in turn (a change in the machine's load hits
all alike); the table gives medians per layer and the speedup over oneDNN. A gate/up shape is timed
as the engine calls it: silu(gate) * up included (PyTorch's ops after oneDNN; the kernels' epilogue).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from engine.models.cpu_linear import GemvLinear, Int8Linear, kernels_unavailable, silu_mul
from engine.models.packed_linear import PackedLinear, packing_supported
from engine.models.quantization import group_for, quantize_int8


@dataclass
class GemvResult:
    shape: str  # "N x K", "(silu)" for the gated MLP's gate/up
    rows: int
    onednn_us: float  # median per layer, oneDNN packed bf16 (F.linear where oneDNN does not pack bf16)
    bf16_us: float  # the bf16 kernel
    int8_us: float  # the INT8 kernel
    bf16_speedup: float  # onednn_us / bf16_us
    int8_speedup: float  # onednn_us / int8_us


def model_shapes(cfg) -> list[tuple[int, int, bool]]:
    """(N, K, gate_up) of a Llama-family decoder's linears and its logits head."""
    heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return [((heads + 2 * kvh) * d, h, False), (h, heads * d, False), (2 * inter, h, True), (h, inter, False),
            (cfg.vocab_size, h, False)]


def _variants(n: int, k: int, gate_up: bool, layers: int, group: int | None):
    """Three lists of `layers` callables x -> y: oneDNN (or F.linear), bf16 kernel, INT8 kernel."""
    big = 1 << 62
    onednn_packs = packing_supported(torch.device("cpu"), torch.bfloat16)
    onednn, bf16, int8 = [], [], []
    for _ in range(layers):
        w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
        packed = PackedLinear(w, None, 32) if onednn_packs else (lambda x, w=w: F.linear(x, w))
        gl = GemvLinear(w, None, big, 32, gate_up, onednn=False)
        il = Int8Linear(quantize_int8(w.float(), group_for(k, group)), None, big, True, gate_up)
        onednn.append((lambda x, p=packed: silu_mul(p(x))) if gate_up else packed)
        bf16.append(gl.silu_mul if gate_up else gl)
        int8.append(il.silu_mul if gate_up else il)
    return onednn, bf16, int8


def measure(n: int, k: int, gate_up: bool, rows: list[int], layers: int, repeats: int,
            group: int | None) -> list[GemvResult]:
    variants = _variants(n, k, gate_up, layers, group)
    return [_time(variants, n, k, gate_up, r, repeats) for r in rows]


def _time(variants, n: int, k: int, gate_up: bool, rows: int, repeats: int) -> GemvResult:
    x = torch.randn(rows, k).to(torch.bfloat16)
    layers = len(variants[0])
    runs: list[list[float]] = [[] for _ in variants]
    with torch.inference_mode():
        for fns in variants:  # warm-up
            for f in fns:
                f(x)
        for _ in range(repeats):
            for fns, r in zip(variants, runs, strict=True):
                t = time.perf_counter()
                for f in fns:
                    f(x)
                r.append((time.perf_counter() - t) / layers * 1e6)
    a, b, c = (statistics.median(r) for r in runs)
    return GemvResult(f"{n}x{k}{' (silu)' if gate_up else ''}", rows, a, b, c, a / b, a / c)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gemv", help="oneDNN vs the small-batch linear kernels, per shape and rows",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-135m", help="model folder or make_model preset (for its shapes)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--layers", type=int, default=30, help="distinct weights per shape (the head: 1)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--group-size", type=int, default=64, help="INT8 columns per scale (0: per channel)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from bench.lib.workloads import resolve_model

    reason = kernels_unavailable("int8")
    if reason is not None:
        print(f"the linear kernels cannot run here: {reason}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = AutoConfig.from_pretrained(str(resolve_model(args.model)))
    group = args.group_size or None
    results = []
    for n, k, gate_up in model_shapes(cfg):
        layers = 1 if n == cfg.vocab_size else args.layers
        results += measure(n, k, gate_up, args.rows, layers, args.repeats, group)
    base = "oneDNN us" if packing_supported(torch.device("cpu"), torch.bfloat16) else "F.linear us"
    print(f"{args.command_line}\n{'shape':>18} {'rows':>5} {base:>11} {'bf16 kernel us':>15} {'x':>6}"
          f" {'int8 kernel us':>15} {'x':>6}")
    for r in results:
        print(f"{r.shape:>18} {r.rows:>5} {r.onednn_us:>11.1f} {r.bf16_us:>15.1f} {r.bf16_speedup:>6.2f}"
              f" {r.int8_us:>15.1f} {r.int8_speedup:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0
