"""Options `load` and `sweep` share (target, prompts, SLOs), and how they become the client's
requests, config and SLO."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.lib.client import ENDPOINTS, LoadConfig, LoadRequest, served_model_name
from bench.lib.load_requests import assign_lanes, jsonl_requests, parse_priority_mix, synthetic_requests
from bench.lib.stats import Slo
from bench.lib.workloads import DEFAULT_MODEL, resolve_model


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Options `load` and `sweep` share: target, prompts, SLOs."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="generate",
                   help="generate: /generate SSE; completions: /v1/completions streaming (default: generate)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="tokenizer for synthetic prompts: a model folder, smollm2-135m-instruct or a make_model preset "
                        "(default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="OpenAI `model` field (default: from /v1/models)")
    p.add_argument("--dataset", type=Path, default=None, help="JSONL prompts instead of synthetic ones")
    p.add_argument("--prompt-len", type=int, default=128, help="synthetic prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos pins the output length)")
    p.add_argument("--priority-mix", default=None, metavar="LANE=W,...",
                   help="send each request with a priority drawn from these weights, e.g. interactive=3,batch=1")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    p.add_argument("--warmup", type=int, default=1, help="untimed short requests first (default: 1)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on TTFT (default: 1000)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput SLO on TPOT (default: 100)")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on end-to-end latency (default: none)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def make_slo(args: argparse.Namespace) -> Slo:
    ms = lambda v: None if v is None else v / 1000  # noqa: E731
    return Slo(ttft=ms(args.slo_ttft_ms), tpot=ms(args.slo_tpot_ms), e2e=ms(args.slo_e2e_ms))


def build_requests(args: argparse.Namespace, num: int | None) -> list[LoadRequest]:
    """The run's requests: the dataset or synthetic prompts, with the priority mix applied."""
    if args.dataset is not None:
        reqs = jsonl_requests(args.dataset, num, args.output_len)
    else:
        reqs = synthetic_requests(str(resolve_model(args.model)), num or 8, args.prompt_len, args.output_len,
                                  args.seed)
    return assign_lanes(reqs, parse_priority_mix(args.priority_mix), args.seed)


def make_config(args: argparse.Namespace, base_url: str, concurrency: int | None) -> LoadConfig:
    name = args.served_model_name
    if args.endpoint == "completions" and name is None:
        name = served_model_name(base_url)
    try:
        return LoadConfig(base_url=base_url, endpoint=args.endpoint, concurrency=concurrency,
                          request_rate=args.request_rate, ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                          seed=args.seed, model_name=name)
    except ValueError as exc:
        raise SystemExit(f"load: {exc}") from None
