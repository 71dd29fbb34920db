"""GGUF block products per call, one weight shape at a time: the bf16 small-batch kernel (the default
dequantized serving path) against the block kernels with float32 activations (ggml_gemv) and with
int8 activations (ggml_gemv_q8), per type and row count.

    python -m bench ggml-gemv --types Q4_1 Q4_0 Q8_0 Q5_0 Q4_K Q6_K --rows 1 2 4 --threads 1

Shapes default to the default model's (SmolLM2-135M: 576x576, 1536x576, 576x1536, the 49152x576
head; K-quant types need K % 256 == 0, so they skip 576 columns). Each shape is timed on `--layers`
distinct random weights (not all in cache, as a model's layers would not be; the head: 1), each variant
once per repeat in turn; the table gives each variant's fastest repeat per call (`--stat median` for
medians: on a machine shared with other jobs the minimum is the one that does not time their load).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.kernels import cpu_kernels
from engine.models.cpu_linear import GemvLinear, kernels_unavailable
from engine.testing.make_gguf import random_blocks

SHAPES = ("576x576", "1536x576", "576x1536", "49152x576")


def _variants(qtype: Q, n: int, k: int, layers: int) -> list[list]:
    ops = torch.ops.tokenmill
    bf16, f32, q8 = [], [], []
    for i in range(layers):
        blocks = torch.from_numpy(random_blocks(qtype, n, k, i))
        w = ops.ggml_dequantize(blocks, int(qtype), n, k, torch.bfloat16)
        bf16.append(GemvLinear(w, None, 1 << 62, 32, False, onednn=False))
        f32.append(lambda x, b=blocks: ops.ggml_gemv(x, b, int(qtype), n, k, None))
        q8.append(lambda x, b=blocks: ops.ggml_gemv_q8(x, b, int(qtype), n, k, None))
    return [bf16, f32, q8]


def _time(variants: list[list], k: int, rows: int, repeats: int, stat: str) -> list[float]:
    x = torch.randn(rows, k)
    xs = [x.bfloat16(), x, x]  # the bf16 path takes bf16 activations, the block kernels float32
    runs: list[list[float]] = [[] for _ in variants]
    with torch.inference_mode():
        for fns, xi in zip(variants, xs, strict=True):
            for f in fns:
                f(xi)
        for _ in range(repeats):
            for fns, xi, r in zip(variants, xs, runs, strict=True):
                t = time.perf_counter()
                for f in fns:
                    f(xi)
                r.append((time.perf_counter() - t) / len(fns) * 1e6)
    return [min(r) if stat == "min" else statistics.median(r) for r in runs]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ggml-gemv", help="GGUF block kernels (float / int8 activations) vs bf16, per call",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="N x K")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=8, help="distinct weights per shape (N > 8192: 1)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stat", choices=["min", "median"], default="min")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reason = kernels_unavailable("bf16") or cpu_kernels.load("ggml")
    if reason is not None:
        print(f"the kernels cannot run here: {reason}")
        return 2
    torch.set_num_threads(args.threads)
    print(f"{args.command_line}\nggml path {torch.ops.tokenmill.ggml_path()}, {args.threads} thread(s), {args.stat} of "
          f"{args.repeats} repeats per call")
    print(f"{'type':>5} {'shape':>10} {'rows':>4} {'bf16 us':>8} {'f32-act us':>10} {'int8-act us':>11} {'int8/bf16':>9}")
    for name in args.types:
        qtype = Q[name]
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            if k % GGML_QUANT_SIZES[qtype][0]:
                continue
            variants = _variants(qtype, n, k, 1 if n > 8192 else args.layers)
            for rows in args.rows:
                b, f, q = _time(variants, k, rows, args.repeats, args.stat)
                print(f"{name:>5} {shape:>10} {rows:>4} {b:>8.1f} {f:>10.1f} {q:>11.1f} {b / q:>9.2f}")
    return 0
