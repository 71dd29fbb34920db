"""Offline throughput: our engine (no HTTP) against transformers, on the same prompts in one process.

Systems:
  engine     every request submitted at once to `Engine.generate` (continuous batching)
  hf-static  `AutoModelForCausalLM.generate` on static batches (left padding, attention mask); a batch
             runs until its longest output, but only the tokens each request asked for are counted
  hf-serial  `generate` one request at a time; by default only a sample is timed and the time per
             output token is extrapolated to the whole workload (the report says so)

All systems use the same dtype, device, torch thread count and `torch.inference_mode()`, decode
greedily with output lengths pinned (ignore_eos / min_new_tokens), and are warmed up once on a tiny
request. With --repeats R the systems run in R interleaved rounds (rotating the order) and each
system's median wall time is reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import engine
from bench.lib.machine import cpu_sample, machine_info, other_cores, wait_quiet
from bench.lib.workloads import (
    DEFAULT_MODEL,
    BenchRequest,
    Workload,
    fixed_workload,
    mixed_workload,
    ordinary_token_ids,
    resolve_model,
)
from engine import Engine, EngineConfig, SamplingParams
from engine.runner.startup import resolve_block_size, resolve_device

SYSTEMS = ("engine", "hf-static", "hf-serial")
_WARMUP = (BenchRequest(tuple(range(100, 108)), 4), BenchRequest(tuple(range(200, 205)), 3))


@dataclass
class SystemResult:
    """One system's numbers over the whole workload."""

    name: str
    requests: int  # requests the numbers stand for (the whole workload)
    output_tokens: int  # useful output tokens: the sum of the requests' output lengths
    wall_s: float  # median wall time over the repeats (extrapolated when `extrapolated`)
    output_tok_s: float  # output_tokens / wall_s
    engine_speedup: float | None  # engine output_tok_s / this output_tok_s; None without an engine run
    extrapolated: bool  # wall_s was extrapolated from timed_requests requests
    timed_requests: int  # requests actually timed per repeat
    runs_wall_s: list[float]  # each repeat's wall time (extrapolated when `extrapolated`)
    runs_other_cores: list[float | None]  # per repeat, cores other processes kept busy (None: unknown)
    # per round, this wall / the engine's wall in the same round: pairs runs made close in time, so
    # slow drifts in the machine's load cancel. Empty without an engine run.
    round_speedups: list[float] = field(default_factory=list)
    note: str = ""


# ---- systems ----------------------------------------------------------------------------------------


class EngineSystem:
    """tokenmill's engine, all requests submitted at once."""

    name = "engine"

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)

    def generate(self, requests: Sequence[BenchRequest]) -> list[list[int]]:
        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
        return [res.token_ids for res in self.engine.generate(prompts, params)]


class HFSerialSystem:
    """transformers generate, one request at a time."""

    name = "hf-serial"

    def __init__(self, model, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def generate(self, requests: Sequence[BenchRequest]) -> list[list[int]]:
        outs = []
        for r in requests:
            ids = torch.tensor([r.prompt_token_ids], device=self.model.device)
            seq = _hf_generate(self.model, ids, torch.ones_like(ids), r.output_len, self.pad_token_id)
            outs.append(seq[0, ids.shape[1]:].tolist())
        return outs


class HFStaticSystem:
    """transformers generate on static, left-padded batches that run until their longest output."""

    name = "hf-static"

    def __init__(self, model, pad_token_id: int, batch_size: int | None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    def generate(self, requests: Sequence[BenchRequest]) -> list[list[int]]:
        size = self.batch_size or len(requests)
        outs: list[list[int]] = []
        for start in range(0, len(requests), size):
            outs.extend(self._batch(requests[start : start + size]))
        return outs

    def _batch(self, batch: Sequence[BenchRequest]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: every prompt ends at column width - 1
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        dev = self.model.device
        longest = max(r.output_len for r in batch)
        seq = _hf_generate(self.model, ids.to(dev), mask.to(dev), longest, self.pad_token_id)
        return [seq[row, width : width + r.output_len].tolist() for row, r in enumerate(batch)]


def engine_config(model: str, workload: Workload, args: argparse.Namespace) -> EngineConfig:
    """The engine's config for this run: KV blocks for every request at once (no preemption, as the
    baselines never preempt) plus the warm-up requests."""
    bs = resolve_block_size(args.block_size, resolve_device(args.device))
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // bs) for r in workload.requests + _WARMUP)
    return EngineConfig(
        model=model, dtype=args.dtype, device=args.device, block_size=bs, num_kv_blocks=blocks + 1,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching, show_progress=False,
    )


def _hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, n: int, pad_token_id: int) -> torch.Tensor:
    # min_new_tokens == max_new_tokens pins the length as ignore_eos does for the engine.
    return model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_token_id
    )


def load_hf_model(model: str, dtype: str, device: str):
    """The transformers model in eval mode, in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    return hf.to(device).eval()


# ---- timing -----------------------------------------------------------------------------------------


def serial_sample(workload: Workload, k: int) -> list[int]:
    """Indices of k requests whose mean prompt and mean output lengths match the workload's as closely
    as a greedy swap search finds. k <= 0 or k >= N: every request.

    hf-serial's time is extrapolated by total / sampled output tokens; with both means matched that is
    exact for a per-request cost linear in prompt and output length (overhead + prefill + decode)."""
    n = workload.num_requests
    if k <= 0 or k >= n:
        return list(range(n))
    lens = [(len(r.prompt_token_ids), r.output_len) for r in workload.requests]
    order = sorted(range(n), key=lambda i: (lens[i][1], lens[i][0], i))
    chosen = [order[(2 * j + 1) * n // (2 * k)] for j in range(k)]  # start: output-length quantiles
    best = _sample_error(chosen, lens, k / n)
    improved = True
    while improved:  # first-improvement swaps; the error strictly falls, so this ends
        improved = False
        for pos in range(k):
            for cand in (i for i in range(n) if i not in chosen):
                trial = chosen[:pos] + [cand] + chosen[pos + 1 :]
                err = _sample_error(trial, lens, k / n)
                if err < best - 1e-12:
                    chosen, best, improved = trial, err, True
    return sorted(chosen)


def _sample_error(idx: list[int], lens: list[tuple[int, int]], frac: float) -> float:
    """Relative error of the sample's prompt and output token sums against frac x the totals."""
    err = 0.0
    for j in (0, 1):
        total = sum(x[j] for x in lens) * frac
        err += abs(sum(lens[i][j] for i in idx) - total) / total
    return err


@dataclass
class Run:
    """One timed generate call."""

    wall_s: float
    other_cores: float | None  # cores other processes kept busy meanwhile
    outputs: list[list[int]]  # per request, its generated token ids


def time_run(system, requests: Sequence[BenchRequest]) -> Run:
    """Time one generate over `requests`; raises if any output length differs from the one asked for."""
    with torch.inference_mode():
        before = cpu_sample()
        t0 = time.perf_counter()
        outs = system.generate(requests)
        wall = time.perf_counter() - t0
        busy = other_cores(before, cpu_sample())
    got = [len(o) for o in outs]
    want = [r.output_len for r in requests]
    if got != want:
        raise RuntimeError(f"{system.name} produced output lengths {got}, expected {want}")
    return Run(wall, busy, outs)


def run_rounds(
    systems: list, workload: Workload, sample: list[int], repeats: int, quiet_wait_s: float, log
) -> dict[str, list[Run]]:
    """Time every system `repeats` times, rotating the order each round; before each run wait up to
    `quiet_wait_s` for other processes to go quiet. hf-serial runs only the `sample` requests."""
    full = list(workload.requests)
    sampled = [full[i] for i in sample]
    runs: dict[str, list[Run]] = {s.name: [] for s in systems}
    for rnd in range(repeats):
        shift = rnd % len(systems)
        for system in systems[shift:] + systems[:shift]:
            if quiet_wait_s > 0:
                wait_quiet(quiet_wait_s)
            serial = system.name == "hf-serial"
            run = time_run(system, sampled if serial else full)
            runs[system.name].append(run)
            busy = "?" if run.other_cores is None else f"{run.other_cores:.2f}"
            log(f"  round {rnd + 1}/{repeats} {system.name}: {run.wall_s:.2f} s"
                + (" (sample)" if serial else "") + f", other processes busy on {busy} cores")
    return runs


def summarize(runs: dict[str, list[Run]], workload: Workload, sample: list[int]) -> list[SystemResult]:
    """One SystemResult per system, in SYSTEMS order, with speedups against the engine. hf-serial's
    sampled wall times are scaled by total output tokens / sampled output tokens."""
    scale = workload.output_tokens / sum(workload.requests[i].output_len for i in sample)
    results = []
    for name in (n for n in SYSTEMS if n in runs):
        walls = [r.wall_s * (scale if name == "hf-serial" else 1.0) for r in runs[name]]
        wall = statistics.median(walls)
        extrapolated = name == "hf-serial" and len(sample) < workload.num_requests
        timed = len(sample) if name == "hf-serial" else workload.num_requests
        note = f"timed {timed} of {workload.num_requests} requests; time per output token extrapolated"
        results.append(SystemResult(
            name=name, requests=workload.num_requests, output_tokens=workload.output_tokens, wall_s=wall,
            output_tok_s=workload.output_tokens / wall, engine_speedup=None, extrapolated=extrapolated,
            timed_requests=timed, runs_wall_s=walls, runs_other_cores=[r.other_cores for r in runs[name]],
            note=note if extrapolated else "",
        ))
    engine = next((r for r in results if r.name == "engine"), None)
    for r in results:
        r.engine_speedup = engine.output_tok_s / r.output_tok_s if engine else None
        r.round_speedups = [w / e for w, e in zip(r.runs_wall_s, engine.runs_wall_s, strict=True)] if engine else []
    return results


def greedy_agreement(runs: dict[str, list[Run]], sample: list[int]) -> dict | None:
    """How many sampled requests the engine and hf-serial decoded identically in the last round.

    Informational: in bf16, near-ties in random-weight logits make correct implementations diverge, and
    the length pinning differs (ignore_eos may pick EOS and go on; min_new_tokens masks EOS)."""
    if "engine" not in runs or "hf-serial" not in runs:
        return None
    pairs = list(zip([runs["engine"][-1].outputs[i] for i in sample], runs["hf-serial"][-1].outputs, strict=True))
    return {
        "compared": len(pairs),
        "identical": sum(a == b for a, b in pairs),
        "common_prefix": [_common_prefix(a, b) for a, b in pairs],  # tokens equal before the first difference
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---- report -----------------------------------------------------------------------------------------


def format_table(results: list[SystemResult]) -> str:
    head = ("system", "requests", "output tokens", "wall s", "output tok/s", "engine speedup",
            "per round (median, range)", "others' cores")
    rows = [head]
    for r in results:
        wall = f"{r.wall_s:.3f}" + ("*" if r.extrapolated else "")
        speedup = f"{r.engine_speedup:.2f}x" if r.engine_speedup is not None else "-"
        busy = [b for b in r.runs_other_cores if b is not None]
        rounds = sorted(r.round_speedups)
        per_round = (f"{statistics.median(rounds):.2f}x ({rounds[0]:.2f}-{rounds[-1]:.2f})" if rounds else "-")
        rows.append((r.name, str(r.requests), str(r.output_tokens), wall, f"{r.output_tok_s:.1f}", speedup,
                     per_round, f"{max(busy):.2f}" if busy else "?"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"* {r.name}: {r.note}" for r in results if r.extrapolated]
    notes.append("engine speedup: engine output tok/s / this system's, from the median walls; per round: "
                 "the same ratio within each interleaved round")
    notes.append("others' cores: the most cores other processes kept busy during any of that system's runs")
    return "\n".join(lines + notes)


# ---- entry point ------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "offline", help="engine vs transformers throughput without HTTP",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workload", choices=("fixed", "mixed"))
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model folder, {DEFAULT_MODEL} or a make_model preset (default: %(default)s)")
    p.add_argument("-n", "--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128, help="fixed: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="fixed: output tokens per request")
    p.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512), metavar=("LO", "HI"),
                   help="mixed: uniform prompt lengths, inclusive")
    p.add_argument("--output-range", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"),
                   help="mixed: uniform output lengths, inclusive")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians are reported")
    p.add_argument("--serial-sample", type=int, default=4,
                   help="hf-serial: time this many requests and extrapolate; 0 = all (default 4)")
    p.add_argument("--static-batch", type=int, default=None, help="hf-static batch size (default: all)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=None, help="default: the engine's (32 on CPU, 16 on CUDA)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="enable the engine's prefix cache (off by default: the baselines have none)")
    p.add_argument("--quiet-wait", type=float, default=0.0, metavar="SECONDS",
                   help="before each timed run, wait up to this long for other processes to go quiet")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The `offline` subcommand: prints the table, writes --json; returns the exit status."""
    source = engine_source_fingerprint()  # now: the files may change on disk while we run
    systems = _parse_systems(args.systems)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"command: {args.command_line}")
    load_before = os.getloadavg()
    print(f"load average (1/5/15 min): {_fmt_load(load_before)} on {os.cpu_count()} CPUs")
    model = resolve_model(args.model)
    workload = _build_workload(args, model)
    print(f"workload: {json.dumps(workload.describe())}")
    sample = serial_sample(workload, args.serial_sample)
    instances = _make_systems(systems, model, workload, args)
    for s in instances:  # warm-up: one tiny request (two for hf-static, to exercise padding)
        time_run(s, _WARMUP if s.name == "hf-static" else _WARMUP[:1])
    runs = run_rounds(instances, workload, sample, args.repeats, args.quiet_wait, lambda m: print(m, flush=True))
    results = summarize(runs, workload, sample)
    report = {
        "command": args.command_line, "model": str(model), "dtype": args.dtype, "device": args.device,
        "machine": machine_info(torch.get_num_threads(), torch.__version__),
        "engine_source_sha256": source,
        "load_before": list(load_before), "load_after": list(os.getloadavg()),
        "workload": workload.describe(), "repeats": args.repeats, "serial_sample": sample,
        "greedy_agreement": greedy_agreement(runs, sample), "systems": [asdict(r) for r in results],
    }
    _print_report(report, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def engine_source_fingerprint() -> str:
    """First 16 hex digits of a sha256 over the engine package's .py files (paths and contents), so a
    report names the engine code it measured even when that code is not committed."""
    root = Path(engine.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _print_report(report: dict, results: list[SystemResult]) -> None:
    print()
    print(format_table(results))
    print(f"load average after: {_fmt_load(report['load_after'])}; engine source {report['engine_source_sha256']}")
    if report["greedy_agreement"]:
        a = report["greedy_agreement"]
        print(f"greedy outputs identical, engine vs hf-serial: {a['identical']}/{a['compared']} sampled requests "
              f"(identical leading tokens: {a['common_prefix']})")


def _parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"--systems: unknown {unknown or 'empty'}; choose from {', '.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in names]


def _build_workload(args: argparse.Namespace, model: Path) -> Workload:
    from transformers import AutoConfig, AutoTokenizer

    vocab = ordinary_token_ids(AutoTokenizer.from_pretrained(str(model)),
                               AutoConfig.from_pretrained(str(model)).vocab_size)
    try:
        if args.workload == "fixed":
            return fixed_workload(vocab, args.num_requests, args.prompt_len, args.output_len, args.seed)
        return mixed_workload(vocab, args.num_requests, tuple(args.prompt_range), tuple(args.output_range),
                              args.seed)
    except ValueError as exc:
        raise SystemExit(f"workload: {exc}") from None


def _make_systems(names: list[str], model: Path, workload: Workload, args: argparse.Namespace) -> list:
    systems: list = []
    if "engine" in names:
        systems.append(EngineSystem(engine_config(str(model), workload, args)))
    if "hf-static" in names or "hf-serial" in names:
        hf = load_hf_model(str(model), args.dtype, args.device)
        pad = hf.generation_config.pad_token_id
        pad = pad if pad is not None else hf.config.eos_token_id
        if "hf-static" in names:
            systems.append(HFStaticSystem(hf, pad, args.static_batch))
        if "hf-serial" in names:
            systems.append(HFSerialSystem(hf, pad))
    return systems


def _fmt_load(load: Sequence[float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)
