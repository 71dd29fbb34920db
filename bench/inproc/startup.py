"""Model load and server start-up: `python -m bench startup`.

    python -m bench startup --repeats 3
    python -m bench startup --models /path/model.gguf /path/hf-folder --dtype bfloat16 --no-server

Two measurements, each in fresh processes (a process's peak RSS only grows, so one load per process):
- load: `open_model_source` + `load_model` (what `Engine` does before the KV cache), with the time of
  each part, the RSS after the imports, the peak RSS (VmHWM) and the model's parameter bytes.
  Default models: the installed SmolLM2-135M-Instruct GGUF and the folder `tokenmill convert` makes
  of it (bench/lib/workloads.py real_model_folder), so the two formats are compared on the same weights.
- server: `python -m server` (no --model: the default model) from launch to the first /health 200.
Medians over --repeats, with the machine's load (other processes' busy cores) per run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.machine import cpu_sample, other_cores, wait_quiet
from bench.lib.server import NotReady, free_port, wait_ready

_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from engine.weights.loader import load_model, peak_rss_bytes, rss_bytes
from engine.weights.model_open import open_model_source
rss0 = rss_bytes()
t1 = time.perf_counter()
src = open_model_source(sys.argv[1])
t2 = time.perf_counter()
rss1 = rss_bytes()
dtype = getattr(torch, sys.argv[2])
model = load_model(src, dtype, torch.device("cpu"), 2048, show_progress=False)
t3 = time.perf_counter()
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "load_s": t3 - t2, "rss_after_imports": rss0,
                  "rss_after_open": rss1, "rss_after_load": rss_bytes(), "peak_rss": peak_rss_bytes(),
                  "model_bytes": nbytes, "format": src.format}))
"""


def probe_load(model: str, dtype: str) -> dict:
    """One load in a fresh interpreter; the probe's JSON plus the other processes' busy cores."""
    before, children = cpu_sample(), _children_cpu_s()
    out = subprocess.run([sys.executable, "-c", _PROBE, model, dtype], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"load probe of {model} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["other_cores"] = _others(before, cpu_sample(), _children_cpu_s() - children)
    return result


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children that ended and were waited for
    return usage.ru_utime + usage.ru_stime


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of a running process (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _others(before, after, probe_cpu_s: float) -> float | None:
    """Cores other processes kept busy: other_cores() counts the probe process as "other", so its
    own CPU time comes off."""
    total = other_cores(before, after)
    if total is None or after.total <= before.total:
        return total
    ticks = probe_cpu_s * os.sysconf("SC_CLK_TCK")
    return max(0.0, total - ticks / (after.total - before.total) * (os.cpu_count() or 1))


def probe_server(args: list[str], timeout: float = 300) -> dict:
    """Seconds from launching `python -m server ARGS` to its first /health 200."""
    port = free_port()
    before = cpu_sample()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        try:
            # polled every 50 ms: the figure is this loop's resolution
            wait_ready(proc, f"http://127.0.0.1:{port}", timeout, interval_s=0.05)
        except NotReady as exc:
            tail = proc.stderr.read()[-2000:] if proc.poll() is not None else ""
            raise SystemExit(f"server {exc}:\n{tail}") from None
        elapsed = time.perf_counter() - t0
        return {"health_s": elapsed, "other_cores": _others(before, cpu_sample(), _process_cpu_s(proc.pid))}
    finally:
        proc.terminate()
        proc.wait(60)


def _default_models() -> list[str]:
    from bench.lib.workloads import real_model_folder
    from server.config.default_model import DEFAULT_MODEL, default_model_file

    gguf = default_model_file()
    if gguf is None:
        raise SystemExit(f"the default model is not installed ({DEFAULT_MODEL.install}); or pass --models")
    return [str(gguf), str(real_model_folder())]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report_load(model: str, runs: list[dict]) -> dict:
    mib = 2**20
    keys = ("import_s", "open_s", "load_s", "rss_after_imports", "rss_after_open", "rss_after_load", "peak_rss")
    row = {k: _median(runs, k) for k in keys}
    row.update(model=model, format=runs[0]["format"], model_bytes=runs[0]["model_bytes"], runs=runs)
    # what loading the weights added at its peak (the tokenizer and metadata are in rss_after_open)
    row["load_peak_over_model"] = (row["peak_rss"] - row["rss_after_open"]) / row["model_bytes"]
    print(f"{Path(model).name:<34} {row['format']:<11} open {row['open_s']:5.2f}s load {row['load_s']:5.2f}s | "
          f"RSS MiB: imports {row['rss_after_imports'] / mib:4.0f}, open {row['rss_after_open'] / mib:4.0f}, "
          f"loaded {row['rss_after_load'] / mib:5.0f}, peak {row['peak_rss'] / mib:5.0f} | params "
          f"{row['model_bytes'] / mib:4.0f} MiB | (peak - open) / params {row['load_peak_over_model']:.2f}")
    return row


def run(args: argparse.Namespace) -> int:
    models = args.models or _default_models()
    print(args.command_line)
    out: dict = {"command": args.command_line, "dtype": args.dtype, "load": [], "server": None}
    for model in models:
        runs = [_quiet(args, probe_load, model, args.dtype) for _ in range(args.repeats)]
        out["load"].append(report_load(model, runs))
    if args.server:
        runs = [_quiet(args, probe_server, args.server_arg) for _ in range(args.repeats)]
        out["server"] = {"args": args.server_arg, "health_s": _median(runs, "health_s"), "runs": runs}
        each = ", ".join(f"{r['health_s']:.1f}" for r in runs)
        print(f"server {' '.join(args.server_arg) or '(default model)'}: launch -> /health 200 "
              f"median {out['server']['health_s']:.1f}s ({each})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def _quiet(args: argparse.Namespace, probe, *probe_args) -> dict:
    """One probe, after waiting up to --quiet-wait seconds for other processes to go quiet."""
    if args.quiet_wait:
        wait_quiet(args.quiet_wait)
    return probe(*probe_args)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("startup", help="model load time, peak RSS, server start-up to /health",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None,
                   help="model paths (default: the SmolLM2 GGUF and its converted folder)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="load dtype (default: float32, what dtype=auto serves the GGUF in on the CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-server", dest="server", action="store_false", help="skip the server start-up timing")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `python -m server` argument (repeatable; default: none, the default model)")
    p.add_argument("--quiet-wait", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to go quiet (default: 0)")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
