"""Quality gate of a quantized engine against the same weights in bf16, teacher-forced.

    python -m bench quality --model PATH --quantization int8

Both engines read the same text (bench/data/quality.txt by default: original prose, a recipe, a
small program, questions and a letter, ~1,600 SmolLM2 tokens) as one prompt and return the logits
at every position (one prefill through the engine's own model, kernels and weights as served).
Reported: top-1 agreement (the share of positions where both engines' most likely next token is
the same) and each engine's perplexity on the text. The gate (issue 13): agreement >= 0.95 and
perplexity within 2% of bf16's; the exit status is 1 when it fails.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import Engine, EngineConfig

DEFAULT_TEXT = Path(__file__).parents[1] / "data" / "quality.txt"  # bench/data/
MIN_AGREEMENT = 0.95
MAX_PPL_CHANGE = 0.02


@dataclass
class QualityResult:
    tokens: int  # positions scored (text tokens - 1)
    reference: str  # what the candidate is compared with, e.g. "bfloat16"
    candidate: str  # e.g. "bfloat16 + int8"
    top1_agreement: float  # share of positions with the same argmax
    ppl_reference: float
    ppl_candidate: float
    ppl_change: float  # ppl_candidate / ppl_reference - 1
    passed: bool  # the gate: agreement >= MIN_AGREEMENT and |ppl_change| <= MAX_PPL_CHANGE
    weight_bytes_reference: int
    weight_bytes_candidate: int


def make_engine(model: str, dtype: str, quantization: str | None, tokens: int, cpu_gemv: str,
                group_size: int | None = 64) -> Engine:
    return Engine(EngineConfig(
        model=model, dtype=dtype, device="cpu", quantization=quantization, cpu_gemv=cpu_gemv,
        quantization_group_size=group_size,
        max_num_seqs=1, max_num_batched_tokens=max(2048, tokens), num_kv_blocks=-(-tokens // 16) + 1,
        block_size=16, enable_prefix_caching=False, show_progress=False,
    ))


@torch.inference_mode()
def prompt_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one prefill of `ids` from an empty cache (blocks 0..)."""
    from engine.attention import BatchLayout
    from engine.models.layers import ForwardContext

    runner, n, bs = engine.runner, len(ids), engine.block_size
    layout = BatchLayout(num_decodes=0, query_lens=[n], context_lens=[n], block_tables=[list(range(-(-n // bs)))],
                         block_size=bs, slot_mapping=torch.arange(n, dtype=torch.long))
    ctx = ForwardContext(runner.backend, runner.backend.build_metadata(layout, engine.device), runner.kv_caches)
    positions = torch.arange(n, dtype=torch.long)
    hidden = runner.model(torch.tensor(ids, dtype=torch.long), positions, ctx)
    return runner.model.compute_logits(hidden).float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL of each next token): logits [T, V] at positions 0..T-2 predict ids[1:]."""
    targets = torch.tensor(ids[1:], dtype=torch.long)
    return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], targets)))


def measure(model: str, text: str, dtype: str, quantization: str, cpu_gemv: str = "auto",
            group_size: int | None = 64) -> QualityResult:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError("the text must be at least two tokens long")
    ref_engine = make_engine(model, dtype, None, len(ids), cpu_gemv)
    ref = prompt_logits(ref_engine, ids)
    ref_bytes = ref_engine.weights.weight_bytes
    del ref_engine
    cand_engine = make_engine(model, dtype, quantization, len(ids), cpu_gemv, group_size)
    cand = prompt_logits(cand_engine, ids)
    agreement = float((ref[:-1].argmax(-1) == cand[:-1].argmax(-1)).float().mean())
    p_ref, p_cand = perplexity(ref, ids), perplexity(cand, ids)
    change = p_cand / p_ref - 1
    return QualityResult(
        tokens=len(ids) - 1, reference=dtype, top1_agreement=agreement,
        candidate=f"{dtype} + {quantization}" + (f" g{group_size}" if group_size else " per-row"),
        ppl_reference=p_ref, ppl_candidate=p_cand, ppl_change=change,
        passed=agreement >= MIN_AGREEMENT and abs(change) <= MAX_PPL_CHANGE,
        weight_bytes_reference=ref_bytes, weight_bytes_candidate=cand_engine.weights.weight_bytes,
    )


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("quality", help="quantized vs bf16: top-1 agreement and perplexity",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (the real weights: see docs/benchmarks/log.md)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file to score")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quantization", default="int8", choices=("int8",))
    p.add_argument("--cpu-gemv", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--group-size", type=int, default=64, help="INT8 columns per scale (0: one per output row)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.lib.workloads import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    text = Path(args.text).read_text(encoding="utf-8")
    r = measure(str(resolve_model(args.model)), text, args.dtype, args.quantization, args.cpu_gemv,
                args.group_size or None)
    print(args.command_line)
    print(f"{'tokens':>7} {'top-1 agree':>12} {'ppl ' + r.reference:>14} {'ppl ' + r.candidate:>22} {'ppl change':>11}"
          f" {'weight MB':>16}  gate")
    print(f"{r.tokens:>7} {r.top1_agreement:>12.4f} {r.ppl_reference:>14.3f} {r.ppl_candidate:>22.3f}"
          f" {r.ppl_change:>+11.2%} {r.weight_bytes_reference / 1e6:>7.1f} -> {r.weight_bytes_candidate / 1e6:<6.1f}"
          f"  {'pass' if r.passed else 'FAIL'} (agreement >= {MIN_AGREEMENT}, |ppl change| <= {MAX_PPL_CHANGE:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(r), indent=2))
    return 0 if r.passed else 1
