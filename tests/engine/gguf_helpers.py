"""GGUF test files (written with gguf.GGUFWriter from the seeded presets, engine/testing/make_gguf.py)
and transformers' own GGUF load as the reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.testing.make_gguf import write_gguf

from .helpers import Case, case_fix

LOGPROB_TOL = 1e-4  # float32: |engine - transformers| log-softmax, the parity suite's tolerance
TOP = 5  # alternatives compared per step


def gguf_path(build_model, folder: Path, preset: str, qtype: str) -> Path:
    """`folder/{preset}.{qtype}.gguf`, written once."""
    out = folder / f"{preset}.{qtype}.gguf"
    if not out.exists():
        write_gguf(build_model(preset), out, qtype)
    return out


def small_case(vocab: int = 2048, seed: int = 0) -> Case:
    """Six prompts from 1 to 260 tokens (random ordinary ids), 8 to 24 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    lengths, max_tokens = [1, 5, 40, 120, 260, 17], [24, 16, 24, 12, 8, 20]
    return case_fix([torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths], max_tokens)


def hf_from_gguf(path: Path):
    """transformers' own load of the file (it dequantizes with the gguf package), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@dataclass
class Greedy:
    tokens: list[list[int]]  # greedy continuation per prompt
    logprobs: list[list[torch.Tensor]]  # per prompt, per step: log-softmax over the vocabulary [vocab]


def hf_greedy(model, prompts: list[list[int]], max_tokens: list[int]) -> Greedy:
    """transformers generate(do_sample=False), one prompt at a time, with each step's log-softmax; it
    stops at the model's EOS, as the engine does."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt, m in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logprobs.append([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    return Greedy(tokens, logprobs)


def logprob_errors(results, ref: Greedy) -> list[float]:
    """Per step, the largest |engine - transformers| over the engine's top-N tokens (and its choice)."""
    errors = []
    for r, steps in zip(results, ref.logprobs, strict=True):
        for lp, want in zip(r.logprobs, steps, strict=False):
            pairs = [(lp.token_id, lp.logprob), *lp.top]
            errors.append(max(abs(v - float(want[t])) for t, v in pairs))
    return errors
