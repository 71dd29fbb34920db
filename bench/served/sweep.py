"""Load sweep: `python -m bench sweep ...` runs `load` over a series of concurrencies and, with
--max-num-seqs, over engine settings (a fresh server per value), finds the knee and draws plots.

Knee: the first concurrency whose output tok/s grew less than 10% over the previous point's while the
latency (--knee-latency, default end-to-end p50) grew more than 50%: past it, more load buys latency,
not throughput. Plots (PNG): throughput vs concurrency, TTFT and TPOT p50/p99 vs concurrency, and
latency vs throughput.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from bench.lib.client import run_point
from bench.lib.server import server_process
from bench.lib.stats import find_knee
from bench.lib.workloads import resolve_model
from bench.served.load_options import add_common_arguments, build_requests, make_config, make_slo

KNEE_LATENCIES = ("e2e_s", "ttft_s", "tpot_s", "itl_s")


def parse_int_list(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; positive, strictly increasing."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values) or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"expected increasing positive integers, got {text!r}")
    return values


def requests_for(concurrency: int, factor: float, minimum: int) -> int:
    """Requests per point: `factor` x concurrency, at least `minimum`."""
    return max(minimum, int(round(factor * concurrency)))


def knee_of(points: Sequence[dict], latency: str = "e2e_s", stat: str = "p50") -> dict | None:
    """The knee of one series of load reports ordered by concurrency, or None."""
    usable = [p for p in points if p.get(latency)]
    i = find_knee([p["concurrency"] for p in usable], [p["output_tok_per_s"] for p in usable],
                  [p[latency][stat] for p in usable])
    if i is None:
        return None
    prev, cur = usable[i - 1], usable[i]
    return {"concurrency": cur["concurrency"], "previous_concurrency": prev["concurrency"],
            "throughput_gain": cur["output_tok_per_s"] / prev["output_tok_per_s"] - 1,
            "latency_growth": cur[latency][stat] / prev[latency][stat] - 1, "latency": f"{latency[:-2]} {stat}"}


# ---- plots ----------------------------------------------------------------------------------------


def plot_sweep(series: Sequence[dict], out_dir: Path, title: str = "") -> list[Path]:
    """Three small PNGs from the sweep's series; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s in series:
        pts = s["points"]
        ax.plot([p["concurrency"] for p in pts], [p["output_tok_per_s"] for p in pts], "o-", label=s["label"])
        if s.get("knee"):
            k = next(p for p in pts if p["concurrency"] == s["knee"]["concurrency"])
            ax.plot(k["concurrency"], k["output_tok_per_s"], "rx", markersize=12)
    _log2_axis(ax, series)
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=7)
    save(fig, "throughput_vs_concurrency.png")

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for s in series:
            pts = [p for p in s["points"] if p.get(key)]
            xs = [p["concurrency"] for p in pts]
            line = ax.plot(xs, [p[key]["p50"] * 1000 for p in pts], "o-", label=f"{s['label']} p50")[0]
            ax.plot(xs, [p[key]["p99"] * 1000 for p in pts], "s--", color=line.get_color(), label=f"{s['label']} p99")
        _log2_axis(ax, series)
        ax.set_ylabel(f"{name} (ms)")
        ax.legend(fontsize=7)
    save(fig, "latency_vs_concurrency.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s in series:
        pts = [p for p in s["points"] if p.get("e2e_s")]
        ax.plot([p["output_tok_per_s"] for p in pts], [p["e2e_s"]["p50"] for p in pts], "o-", label=s["label"])
        for p in pts:
            ax.annotate(str(p["concurrency"]), (p["output_tok_per_s"], p["e2e_s"]["p50"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("end-to-end latency p50 (s)")
    ax.legend(fontsize=7)
    save(fig, "latency_vs_throughput.png")
    return paths


def _log2_axis(ax, series: Sequence[dict]) -> None:
    ticks = sorted({p["concurrency"] for s in series for p in s["points"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("concurrency")
    ax.grid(True, alpha=0.3)


# ---- entry point ----------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="load over concurrencies (and max_num_seqs): knee and plots",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--concurrencies", default="1,2,4,8,16,32,64", help="default: %(default)s")
    p.add_argument("--requests-factor", type=float, default=2.0, help="requests per point = factor x concurrency")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per point")
    p.add_argument("--max-num-seqs", default=None, metavar="N,N,...",
                   help="start a server per value (--model's weights) instead of using --base-url")
    p.add_argument("--dtype", default="bfloat16", help="server dtype when starting servers")
    p.add_argument("--port", type=int, default=8123, help="port for started servers (127.0.0.1)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for started servers (repeatable), e.g. --server-arg=--max-num-batched-tokens=4096")
    p.add_argument("--knee-latency", choices=KNEE_LATENCIES, default="e2e_s", help="latency the knee watches")
    p.add_argument("--out", type=Path, default=Path("bench-results/sweep"), help="JSON, server logs and plots")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.set_defaults(func=run)


def run_series(args: argparse.Namespace, base_url: str, concurrencies: list[int], label: str) -> dict:
    """One series: a load point per concurrency against `base_url`."""
    points = []
    slo = make_slo(args)
    for i, c in enumerate(concurrencies):
        n = requests_for(c, args.requests_factor, args.min_requests)
        # each point gets its own prompts (seed + 1000 i), so no point hits a prefix cache an earlier one filled
        point_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * i})
        reqs = build_requests(point_args, n)
        report = run_point(reqs, make_config(point_args, base_url, c), slo, args.warmup, args.progress)
        report["concurrency"] = c
        points.append(report)
        ttft, tpot = report.get("ttft_s") or {}, report.get("tpot_s") or {}
        print(f"  {label} c={c:<3} n={n:<3} out tok/s {report['output_tok_per_s']:8.1f}  req/s "
              f"{report['request_per_s']:6.3f}  TTFT p50 {ttft.get('p50', float('nan')) * 1000:8.1f} ms  "
              f"TPOT p50 {tpot.get('p50', float('nan')) * 1000:7.1f} ms  ok {report['counts']['ok']}/{n}"
              f"  cached prompt tokens {report['cached_prompt_tokens']}", flush=True)
    return {"label": label, "points": points, "knee": knee_of(points, args.knee_latency)}


def run(args: argparse.Namespace) -> int:
    """The `sweep` subcommand: prints a line per point and the knees, writes sweep.json and plots."""
    try:
        concurrencies = parse_int_list(args.concurrencies)
        seqs = parse_int_list(args.max_num_seqs) if args.max_num_seqs else None
    except ValueError as exc:
        raise SystemExit(f"sweep: {exc}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"command: {args.command_line}")
    print(f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    series = []
    if seqs is None:
        series.append(run_series(args, args.base_url.rstrip("/"), concurrencies, "server"))
    else:
        model = resolve_model(args.model)
        for v in seqs:
            with server_process(model, args.port, v, args.dtype, args.server_arg,
                                args.out / f"server-max-num-seqs-{v}.log") as url:
                series.append(run_series(args, url, concurrencies, f"max_num_seqs={v}"))
    for s in series:
        k = s["knee"]
        print(f"knee ({s['label']}): " + (
            f"concurrency {k['concurrency']} (from {k['previous_concurrency']}: throughput "
            f"{k['throughput_gain']:+.0%}, {k['latency']} {k['latency_growth']:+.0%})" if k
            else "none (throughput kept growing >= 10% or latency < 50% at every step)"))
    report = {"command": args.command_line, "load_after": list(os.getloadavg()), "series": series}
    (args.out / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'sweep.json'}")
    if args.plots:
        title = f"{Path(args.model).name} {args.prompt_len}/{args.output_len} tokens, {args.endpoint}"
        for path in plot_sweep(series, args.out, title):
            print(f"wrote {path}")
    return 0
