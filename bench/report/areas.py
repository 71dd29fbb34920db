"""The benchmarks page's tables: for each area, the columns its records' rows fill.

A column names a path into a row (`("points", "1", "tok_s")`: row["points"]["1"]["tok_s"]), or several
shown together ("394 / 1362"), and how many decimals a number gets. A missing cell is "-": a figure the
run did not report is not made up.
"""

from __future__ import annotations

from dataclasses import dataclass

Path_ = tuple[str, ...]


@dataclass(frozen=True)
class Column:
    """One column: its header, the row paths it shows (joined by `sep`), decimals for numbers."""

    header: str
    paths: tuple[Path_, ...]
    digits: int | None = None  # None: numbers as written in the record
    sep: str = " / "


def col(header: str, *paths: str, digits: int | None = None, sep: str = " / ") -> Column:
    """Column("c1 tok/s", ("points", "1", "tok_s")) written as col("c1 tok/s", "points.1.tok_s")."""
    return Column(header, tuple(tuple(p.split(".")) for p in paths), digits, sep)


@dataclass(frozen=True)
class Area:
    """A table of the page: what it measures (its heading's words) and its columns."""

    title: str
    columns: tuple[Column, ...]


def _served(*extra: Column) -> tuple[Column, ...]:
    # the side-by-side client's figures (vLLM's `vllm bench serve`, random 128/128, ignore_eos)
    return (col("system", "system"), col("c1 tok/s", "points.1.tok_s", digits=1),
            col("c1 TPOT p50 ms", "points.1.tpot_p50_ms", digits=1), col("c16 tok/s", "points.16.tok_s", digits=1),
            col("c16 TTFT p50 ms", "points.16.ttft_p50_ms", digits=0), col("c32 tok/s", "points.32.tok_s", digits=1),
            col("c32 TTFT p50 / p99 ms", "points.32.ttft_p50_ms", "points.32.ttft_p99_ms", digits=0),
            col("c32 TPOT p50 ms", "points.32.tpot_p50_ms", digits=1), *extra)


AREAS: dict[str, Area] = {
    "peers": Area("Served throughput beside vLLM and llama.cpp", _served(
        col("done c1, c16, c32", "points.1.done", "points.16.done", "points.32.done", sep=", "))),
    "int8": Area("INT8 weights beside llama.cpp's Q8_0", _served()),
    "gguf": Area("GGUF blocks (the default) beside dequantized bf16 and llama.cpp, same file", _served(
        col("done c1, c16, c32", "points.1.done", "points.16.done", "points.32.done", sep=", "))),
    "moe": Area("Mixture of experts (OLMoE-shaped, random weights) beside llama.cpp", _served(
        col("done c1, c16, c32", "points.1.done", "points.16.done", "points.32.done", sep=", "))),
    "gemma3": Area("Gemma 3 270M (Q4_K_M GGUF) beside llama.cpp", _served(
        col("done c1, c16, c32", "points.1.done", "points.16.done", "points.32.done", sep=", "))),
    "int8-quality": Area("INT8 quality gate", (
        col("INT8 scheme", "scheme"), col("top-1 agreement with bf16", "top1"), col("perplexity", "perplexity"),
        col("weight MB", "weight_mb"), col("gate", "gate"))),
    "lora-served": Area("LoRA over HTTP beside vLLM", (
        col("system", "system"), col("c", "c"), col("base tok/s", "base_tok_s", digits=1),
        col("4 adapters tok/s", "lora_tok_s", digits=1), col("adapters / base", "ratio", digits=2),
        col("TPOT p50 base -> adapters", "tpot"))),
    "lora-engine": Area("LoRA in the engine", (
        col("c", "c"), col("base tok/s (TPOT)", "base"), col("1 adapter", "r1"), col("4 adapters", "r4"),
        col("16 adapters", "r16"))),
    "spec-served": Area("Speculative decoding over HTTP beside llama.cpp", (
        col("system", "system"), col("c1 tok/s", "c1_tok_s", digits=1), col("c4 tok/s", "c4_tok_s", digits=1),
        col("gain c1 / c4", "gain"))),
    "spec-engine": Area("Speculative decoding in the engine", (
        col("workload, proposer", "workload"), col("c", "c"), col("off tok/s", "off_tok_s", digits=1),
        col("on tok/s", "on_tok_s", digits=1), col("speedup", "speedup"), col("steps off -> on", "steps"),
        col("acceptance", "acceptance"), col("identical answers", "identical"))),
    "determinism": Area("Batch-invariant mode (`--deterministic`)", (
        col("c", "c"), col("off tok/s", "off_tok_s", digits=1), col("on tok/s", "on_tok_s", digits=1),
        col("cost (median; best round)", "cost"), col("same tokens as c1: off / on", "same_off", "same_on"))),
    "priority": Area("Priority under saturation", (
        col("idle TTFT ms", "idle_ttft_ms"), col("interactive TTFT p50 / p99 ms", "ttft_p50_ms", "ttft_p99_ms"),
        col("bound ms", "bound_ms"), col("failed", "failed"), col("mixed / one-lane tok/s", "mixed_tok_s",
                                                                   "one_lane_tok_s"),
        col("TTFT behind a 7,000-token prefill", "long_prefill"))),
    "tenants": Area("Tenants: fair share inside a lane", (
        col("phase", "phase"), col("streams big / small", "big_streams", "small_streams"),
        col("small queue p50 / p99 ms", "small_queue_p50_ms", "small_queue_p99_ms", digits=0),
        col("idle queue p50 ms", "idle_queue_p50_ms", digits=0),
        col("small / idle queue p50 steps", "small_queue_steps_p50", "idle_queue_steps_p50", digits=1),
        col("big queue p50 ms", "big_queue_p50_ms", digits=0),
        col("big's token share", "big_share"), col("output tok/s", "tok_s", digits=1),
        col("scheduler us/step 1 / 16 tenants", "sched_us_1", "sched_us_16", digits=0))),
    "contention": Area("Engine threads beside a one-core hog", (
        col("engine threads", "variant"), col("quiet tok/s", "quiet_tok_s", digits=1),
        col("beside the hog tok/s", "busy_tok_s", digits=1), col("threads at the end", "threads"))),
    "router": Area("Replicas behind vllm-router", (
        col("policy", "policy"), col("replicas", "replicas"), col("prefix hit rate", "hit_rate", digits=3),
        col("requests per replica", "requests"), col("TTFT p50 / p99 s", "ttft_p50_s", "ttft_p99_s", digits=2),
        col("req/s", "req_s", digits=2), col("output tok/s", "tok_s", digits=1))),
    "startup": Area("Model load and server start-up", (col("what", "what"), col("measured", "measured"))),
    "swap": Area("Model version swap under load, and the response cache", (
        col("versions", "model"), col("swap (load -> old unloaded)", "swap"), col("promote call", "promote"),
        col("failed requests", "failed"), col("RSS before -> peak -> after MiB", "rss"),
        col("generation -> cache hit (server)", "cache"))),
    "structured": Area("Structured outputs", (
        col("arm", "arm"), col("c16 output tok/s (median of 7 rounds)", "tok_s", digits=1),
        col("TTFT p50 ms", "ttft_p50_ms", digits=1))),
}
