"""A mixture-of-experts model's decode step at one request against the floor of its ACTIVE weights.

    python -m bench moe --model bench-olmoe --threads 2 [--gguf /tmp/bench-olmoe.F16.gguf]

A token of an MoE model reads only its top-k experts' weights in each sparse layer, so at batch 1 a
decode step can approach the time it takes to read the active weights, not the whole model. The
floor is the bytes a token reads in the served precision (the dense linears: attention and the logits
head; each router; top_k experts' gate/up and down per sparse layer, at the expert modules' own
bytes) over this machine's read bandwidth, measured in the same process on the same threads (floor.py's
probe, over a buffer as large as those bytes). The ratio is the median decode step over that floor
(issue 41's target: within 1.3x). The embedding's one row a token is left out (bytes of one row).

`--gguf PATH` also writes the model as a GGUF file (F16, engine/testing/make_gguf.py) for
bench/peers/compare.sh, which serves the folder with tokenmill and the file with llama.cpp's server.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class MoeResult:
    model: str
    threads: int
    total_bytes: int  # every linear's weight bytes (all experts)
    active_bytes: int  # what one token reads (top-k experts per sparse layer)
    experts: int
    top_k: int
    read_gbps: float  # median read bandwidth over a buffer of max(active_bytes, 64 MiB)
    floor_ms: float  # active_bytes / read bandwidth
    step_ms: float  # median decode step, one request
    ratio: float  # step_ms / floor_ms
    steps_ms: list[float]


def _bytes(mod: nn.Module) -> int:
    """A linear module's weight bytes as served (the kernels' own layout where they report one)."""
    given = getattr(mod, "weight_bytes", None)
    if given is not None:
        return int(given)
    return sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))


def total_bytes(model: nn.Module, active: int) -> tuple[int, int, int]:
    """(every linear's bytes, experts per sparse layer, top_k) from `active`, the bytes a token reads
    (Engine.weights.weight_bytes: each sparse layer's experts at top_k / num_experts of their bytes)."""
    from engine.models.moe import SparseMoeBlock

    total, experts, top_k = active, 0, 0
    for block in [m for m in model.modules() if isinstance(m, SparseMoeBlock)]:
        ex = block.experts
        if ex.gate_up is None or ex.down is None:
            raise SystemExit("the experts are still stacked (not a CPU engine?)")
        layer = sum(_bytes(m) for m in ex.gate_up) + sum(_bytes(m) for m in ex.down)
        experts, top_k = ex.num_experts, block.top_k
        total += layer - layer * top_k // ex.num_experts
    if not experts:
        raise SystemExit("--model: not a mixture-of-experts model")
    return total, experts, top_k


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("moe", help="MoE decode at one request vs its active-weight floor",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-olmoe", help="MoE model folder or make_model preset")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps")
    p.add_argument("--gguf", default=None, help="also write the model as an F16 GGUF file here")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.inproc.floor import decode_engine, read_buffer, time_read, time_steps
    from bench.lib.workloads import resolve_model

    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    if args.gguf:
        from engine.testing.make_gguf import write_gguf

        write_gguf(folder, args.gguf, "F16")
        print(f"wrote {args.gguf}")
    engine = decode_engine(str(folder), args.dtype, 1, args.context, args.steps + 8)
    active = engine.weights.weight_bytes  # (what one token reads: the experts at top_k / E)
    total, experts, top_k = total_bytes(engine.runner.model, active)
    buf = read_buffer(active)
    time_read(buf)
    time_steps(engine, 2)  # warm-up
    steps, reads = [], []
    for _ in range(args.steps):  # interleaved: a drift in the machine's load hits both alike
        steps += time_steps(engine, 1)
        reads.append(buf.numel() * 8 / time_read(buf) / 1e9)
    gbps, step = statistics.median(reads), statistics.median(steps)
    floor_ms = active / (gbps * 1e9) * 1e3
    r = MoeResult(args.model, args.threads, total, active, experts, top_k, round(gbps, 2), round(floor_ms, 2),
                  round(step, 2), round(step / floor_ms, 3), [round(s, 3) for s in steps])  # fmt: skip
    print(f"{r.model}: {experts} experts, top-{top_k}; weights {total / 2**20:.0f} MiB, active a token "
          f"{active / 2**20:.0f} MiB; read {gbps:.1f} GB/s -> floor {floor_ms:.2f} ms; decode step p50 "
          f"{step:.2f} ms ({r.ratio:.2f}x the floor), {args.threads} thread(s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(r), f, indent=2)
    return 0
