"""Command line of the benchmarks: `python -m bench <subcommand> ...`, also `tokenmill bench ...`.

Each subcommand lives in its own module with `add_parser(subparsers)`, which registers its options
and sets `func(args) -> int`. In this process (bench/inproc/): `offline`, `floor`, `moe` (an MoE model's decode
vs its active-weight floor), `quality`, `gemv`, `ggml-gemv`,
`fused`, `lora` (what LoRA adapters cost), `spec`, `linear-ab`, `determinism` (batch-invariant mode
on/off), `startup`, `multiturn` (a hybrid model's turn-2 TTFT with state checkpoints vs without). Against a served `python -m server` (bench/served/): `load` (HTTP load test),
`sweep`, `priority`, `long-prompt`, `spec-http`, `structured` (what structured outputs cost in
throughput and TTFT), `swap` (model version swap under load, response cache latency), `contention`.
Several replicas (bench/fleet/): `router` (replicas behind vllm-router, per policy), `fleet-sim` (the
router policies at 100 replicas and 10,000 tenants, simulated). The results page (bench/report/):
`report` (docs/BENCHMARKS.md's tables from the committed result records).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from bench.fleet import fleet_sim, router
from bench.inproc import (
    determinism,
    floor,
    fused,
    gemv,
    ggml_gemv,
    linear_ab,
    lora,
    moe,
    multiturn,
    offline,
    quality,
    spec,
    startup,
)
from bench.report import command as report
from bench.served import contention, load, long_prompt, priority, spec_http, structured, swap, sweep, tenants


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="tokenmill benchmarks")
    subparsers = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    offline.add_parser(subparsers)
    floor.add_parser(subparsers)
    moe.add_parser(subparsers)
    multiturn.add_parser(subparsers)
    quality.add_parser(subparsers)
    gemv.add_parser(subparsers)
    ggml_gemv.add_parser(subparsers)
    fused.add_parser(subparsers)
    load.add_parser(subparsers)
    sweep.add_parser(subparsers)
    priority.add_parser(subparsers)
    tenants.add_parser(subparsers)
    long_prompt.add_parser(subparsers)
    startup.add_parser(subparsers)
    swap.add_parser(subparsers)
    structured.add_parser(subparsers)
    spec.add_parser(subparsers)
    contention.add_parser(subparsers)
    router.add_parser(subparsers)
    lora.add_parser(subparsers)
    spec_http.add_parser(subparsers)
    linear_ab.add_parser(subparsers)
    determinism.add_parser(subparsers)
    fleet_sim.add_parser(subparsers)
    report.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m bench") -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.command_line = shlex.join([*shlex.split(prog), *argv])
    return args.func(args)
