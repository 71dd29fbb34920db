"""Flags vLLM users carry over to `tokenmill serve`. Those whose meaning we have are our own settings
under the same names (`--served-model-name`, `--max-model-len`, `--gpu-memory-utilization`,
`--max-num-seqs`, `--enable-prefix-caching`, `--chat-template`, `--api-key`, `--tokenizer`, `--dtype`,
`--block-size`, `--max-num-batched-tokens`, `--seed`, `--enforce-eager`, `--host`, `--port`,
`--speculative-config`, `--kv-events-config`, `--enable-lora`, `--lora-modules`, `--max-loras`,
`--max-lora-rank`, `--max-cpu-loras`, `--reasoning-parser`), and the
model may be given as `tokenmill serve MODEL`. Any other flag ends the command before anything loads
with one line naming every such flag (vLLM's known ones apart from unknown ones), exit code 2:
argparse alone would stop at the first, and read a vLLM flag's value as the model path.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

VLLM_DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}  # vLLM's --dtype names

# vLLM `serve` flags with no tokenmill equivalent (the common ones; any other unknown flag is "unknown").
VLLM_ONLY = frozenset({
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
    "--distributed-executor-backend", "--quantization", "-q", "--kv-cache-dtype", "--swap-space",
    "--cpu-offload-gb", "--trust-remote-code", "--download-dir", "--load-format", "--revision",
    "--code-revision", "--tokenizer-revision", "--tokenizer-mode", "--num-speculative-tokens",
    "--guided-decoding-backend", "--enable-auto-tool-choice", "--tool-call-parser",
    "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats",
    "--uvicorn-log-level", "--max-seq-len-to-capture", "--limit-mm-per-prompt", "--mm-processor-kwargs",
    "--override-generation-config", "--generation-config", "--hf-overrides", "--rope-scaling", "--rope-theta",
    "--max-logprobs", "--disable-sliding-window", "--enable-expert-parallel", "--compilation-config", "-O",
    "--kv-transfer-config", "--scheduling-policy", "--preemption-mode", "--num-scheduler-steps",
    "--response-role", "--ssl-keyfile", "--ssl-certfile", "--root-path", "--middleware", "--allowed-origins",
    "--enable-request-id-headers", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
    "--chat-template-content-format", "--device", "--model-impl", "--served-model-names",
})  # fmt: skip
_NUMBER = re.compile(r"^-\d")


def flag_problems(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """One line naming every flag in `argv` that `parser` does not know, or None when all are known."""
    known = parser._option_string_actions  # argparse's own table of option strings
    vllm: list[str] = []
    unknown: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--":
            break
        if not token.startswith("-") or _NUMBER.match(token):
            continue
        name, has_value = token.split("=", 1)[0], "=" in token
        action = known.get(name)
        if action is not None:
            skip = not has_value and action.nargs != 0  # its value may look like a flag
            continue
        (vllm if name in VLLM_ONLY else unknown).append(name)
    if not vllm and not unknown:
        return None
    parts = []
    if vllm:
        parts.append(f"vLLM flags without a tokenmill equivalent: {', '.join(vllm)}")
    if unknown:
        parts.append(f"unknown flags: {', '.join(unknown)}")
    return "tokenmill serve: " + "; ".join(parts) + " (tokenmill serve --help lists every setting)"
