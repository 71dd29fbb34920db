"""An interactive request behind one long batch-lane prompt in prefill, against a running server:

    python -m bench long-prompt --base-url URL --prompt-tokens 7000

Sends one interactive request alone (its TTFT is the reference), then a batch-lane completion with a
`--prompt-tokens` token prompt, and `--delay` seconds later a short interactive one; reports both
interactive TTFTs and the long request's time. The scheduler's promise (docs/ENGINE.md, "Scheduling"):
the long prefill is chunked and yields each step to the interactive request, so it waits a few steps
at most, not for the whole prefill.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import httpx

SHORT_PROMPT = "Hello there, how are"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("long-prompt", help="interactive TTFT behind one long batch prefill")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--prompt-tokens", type=int, default=7000, help="the long prompt's length (words ~ tokens)")
    p.add_argument("--delay", type=float, default=0.3, help="seconds between the long request and the short one")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def first_token_s(base_url: str, lane: str, timeout: float) -> float:
    """Seconds to the first streamed text of a 4-token completion in `lane`."""
    t = time.perf_counter()
    body = {"prompt": SHORT_PROMPT, "max_tokens": 4, "stream": True, "priority": lane, "temperature": 0}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter() - t
    raise RuntimeError("the stream ended without a token")


def run(args: argparse.Namespace) -> int:
    url = args.base_url.rstrip("/")
    words = ("the quick brown fox jumps over a lazy dog " * (args.prompt_tokens // 9 + 2)).split()
    long_body = {"prompt": " ".join(words[: args.prompt_tokens]), "max_tokens": 4, "priority": "batch"}
    res: dict[str, Any] = {"prompt_tokens_asked": args.prompt_tokens, "idle_ttft_s": first_token_s(url, "interactive", args.timeout)}

    def send_long() -> None:
        t = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=long_body, timeout=args.timeout)
        res["long_s"], res["long_status"] = time.perf_counter() - t, r.status_code
        res["long_prompt_tokens"] = r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else None

    thread = threading.Thread(target=send_long)
    thread.start()
    time.sleep(args.delay)
    res["ttft_behind_long_s"] = first_token_s(url, "interactive", args.timeout)
    thread.join()
    print(f"idle interactive TTFT {res['idle_ttft_s'] * 1000:.0f} ms; behind a {res['long_prompt_tokens']}-token "
          f"batch prefill {res['ttft_behind_long_s'] * 1000:.0f} ms; the long request took {res['long_s']:.2f} s "
          f"(status {res['long_status']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["long_status"] == 200 else 1
