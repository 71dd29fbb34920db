"""Reference outputs from transformers and engine factories for the engine tests."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams

TINY_PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
# The other Llama-like families: the Python layers only (the C++ decode loop declines them); in the
# parity suite (their adapters: tests/engine/test_lora.py's own tests for them).
FAMILY_PRESETS = ["tiny-olmo2", "tiny-granite", "tiny-smollm3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3"]
# Mixture of experts (engine/models/moe.py): the Python layers only (the C++ decode loop declines them)
MOE_PRESETS = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-olmoe", "tiny-mixtral", "tiny-gpt-oss"]
# Sliding windows shorter than the test prompts: Mistral's on every layer (out-of-window blocks freed),
# Qwen2's on some layers (engine/models/windows.py)
WINDOW_PRESETS = ["tiny-mistral-swa", "tiny-qwen2-swa"]
# LongRoPE switching at 32 tokens (most test prompts pass it; shorter ones cross it while generating)
LONGROPE_PRESETS = ["tiny-phi3-longrope"]


@dataclass
class Case:
    prompts: list[list[int]]
    max_tokens: list[int]


def make_case(vocab: int, n: int = 48, seed: int = 0, shared_prefix: int = 0) -> Case:
    """n prompts of 1..300 tokens, max_tokens 1..64; with shared_prefix, every other prompt
    starts with the same shared_prefix tokens (so prefix caching has something to find)."""
    g = torch.Generator().manual_seed(seed)
    # Avoid low ids (special tokens) so prompts are ordinary text tokens.
    prefix = torch.randint(10, vocab, (shared_prefix,), generator=g).tolist()
    prompts, max_tokens = [], []
    for i in range(n):
        length = int(torch.randint(1, 301, (1,), generator=g))
        body = torch.randint(10, vocab, (length,), generator=g).tolist()
        if shared_prefix and i % 2 == 0:
            body = (prefix + body)[: max(length, shared_prefix + 1)]
        prompts.append(body)
        max_tokens.append(int(torch.randint(1, 65, (1,), generator=g)))
    # Make sure the extremes are covered.
    prompts[0], max_tokens[0] = prompts[0][:1], 64
    prompts[1], max_tokens[1] = (prompts[1] * 300)[:300], 1
    return case_fix(prompts, max_tokens)


def case_fix(prompts, max_tokens) -> Case:
    return Case([list(p) for p in prompts], list(max_tokens))


@dataclass
class Reference:
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # log-softmax of the chosen tokens, per step


def hf_reference(path, case: Case) -> Reference:
    """transformers generate(do_sample=False), one prompt at a time, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt, m in zip(case.prompts, case.max_tokens, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=model.config.eos_token_id,
            )
            new = out.sequences[0, len(prompt):].tolist()
            lps = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, new, strict=True)]
            tokens.append(new)
            logprobs.append(lps)
    return Reference(tokens, logprobs)


def make_engine(path, **overrides) -> Engine:
    kw = dict(model=str(path), dtype="float32", device="cpu", num_kv_blocks=2048, show_progress=False)
    kw.update(overrides)
    return Engine(EngineConfig(**kw))


def greedy(m: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=m, temperature=0.0, **kw)


def run_all(engine: Engine, case: Case, **kw) -> list[list[int]]:
    res = engine.generate(case.prompts, [greedy(m, **kw) for m in case.max_tokens])
    return [r.token_ids for r in res]


def assert_idle(engine: Engine) -> None:
    """No request left, no block held, bookkeeping consistent."""
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0
    assert engine.stats().running == 0 and engine.stats().waiting == 0


def mismatches(got: list[list[int]], want: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]


def require_cpu_kernels(*groups: str) -> None:
    """Module-level guard of the CPU-kernel tests: the kernel groups (default: every one) must build
    under CI and wherever a C++ compiler is on PATH (a failure there fails the module); only a machine
    without one skips."""
    from engine.kernels import cpu_kernels
    reasons = [f"{g}: {r}" for g in groups or cpu_kernels.GROUPS if (r := cpu_kernels._load_all()[g]) is not None]
    reason = "; ".join(reasons) or None
    if reason is None:
        return
    if os.environ.get("CI") or shutil.which("g++") or shutil.which("c++"):
        raise RuntimeError(f"the CPU kernels must build here: {reason}")
    pytest.skip(f"no C++ compiler: {reason}", allow_module_level=True)


def spec_engine(path, **overrides) -> Engine:
    """make_engine (with `speculative=` among the overrides) without the measured speculation gate:
    every eligible step speculates, so tests can count drafts (the gate has its own tests)."""
    engine = make_engine(path, **overrides)
    engine.scheduler.spec_gate = None
    return engine
