"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from engine.api.errors import InvalidParam
from engine.structured.spec import GrammarSpec

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32 (1e-45
# turns every logit into inf and the softmax into NaN), and above it the distribution is one-hot anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# Repetition penalties are bounded away from 0 and inf: a logit divided by 1e-300 is inf.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token in practice, +100 all but forces it
MAX_LOGPROBS = 20  # top-N alternatives at most (sampled and prompt tokens)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below GREEDY_TEMPERATURE_EPS) means greedy. Every invalid value raises
    ``InvalidParam`` (a ValueError) naming the field.
    """

    max_tokens: int = 16  # 0 only with prompt_logprobs: the prompt runs, nothing is sampled
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None  # None: none; 0: chosen token only; N: chosen + top-N
    # Log-probabilities of the prompt's tokens (each given the ones before it; the first has none): None:
    # none; 0: each prompt token's own; N: + top-N. Such a request computes its whole prompt (no prefix
    # cache) and the logits of every prompt position, in chunks (engine/sample/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling (greedy too), sorted by token id;
    # logprobs stay those of the model's raw distribution. A dict is accepted and stored sorted.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # The output's grammar (JSON schema, regex, choice, EBNF, tool calls); None: unconstrained. Hashed by
    # its kind and source only (the compiled grammar it carries is not part of eq/hash).
    structured: GrammarSpec | None = None
    # False: this request never speculates (when the engine does; engine/spec/drafts.py). Output is the
    # same either way for greedy requests, and the same in distribution for sampled ones.
    speculative: bool = True
    # The LoRA adapter this request runs on, by the name it was loaded under (engine/lora/); None: the
    # base model. The server sets it from a request's `model` naming an adapter.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers, store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, lo=0 if self.prompt_logprobs is not None else 1)
        _check_num("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_num("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_num("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParam("ignore_eos", "ignore_eos must be a boolean")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise InvalidParam("model", f"an adapter name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.speculative, bool):
            raise InvalidParam("speculative", "speculative must be a boolean")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParam("stop", "stop must contain non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS)
        if self.logit_bias and not _bias_ok(self.logit_bias):  # the loop below names the bad entry
            for token, bias in self.logit_bias:
                _check_int("logit_bias", token, lo=0)
                _check_num("logit_bias", bias, *LOGIT_BIAS_RANGE)
        if self.structured is not None:
            if not isinstance(self.structured, GrammarSpec):
                raise InvalidParam("structured", "structured must be a GrammarSpec")
            if self.min_tokens:  # the grammar alone decides where the output may end
                raise InvalidParam("min_tokens", "min_tokens cannot be combined with a structured output")

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy with another seed (sample j of n). Only the seed is checked: the rest was validated when
        this one was built, and re-validating a full-vocabulary logit_bias per sample is ~50k checks."""
        _check_int("seed", seed, lo=-(2**63), hi=2**64 - 1)
        other = copy.copy(self)
        object.__setattr__(other, "seed", seed)
        return other

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict or pairs; values are checked later."""
    items: Any = value.items() if isinstance(value, dict) else value  # anything: a bad shape raises below
    try:
        pairs = [(t, b) for t, b in items or ()]
    except (TypeError, ValueError):
        raise InvalidParam("logit_bias", "logit_bias must map token ids to numbers") from None
    if len({t for t, _ in pairs}) != len(pairs):
        raise InvalidParam("logit_bias", "logit_bias names a token id twice")
    try:
        return tuple(sorted(pairs))
    except TypeError:
        raise InvalidParam("logit_bias", "logit_bias keys must be integer token ids") from None


def _bias_ok(pairs: tuple[tuple[int, float], ...]) -> bool:
    """Whether every (token id, bias) pair is valid, checked in bulk: a full-vocabulary bias is ~50k pairs,
    and a request with n samples validates one SamplingParams per sample. `pairs` is sorted by token id."""
    ids = [t for t, _ in pairs]
    values = [b for _, b in pairs]
    if not all(type(t) is int for t in ids) or ids[0] < 0:  # bool is not an int here
        return False
    if not all(type(b) is float or type(b) is int for b in values):
        return False
    lo, hi = LOGIT_BIAS_RANGE
    return all(b == b for b in values) and lo <= min(values) and max(values) <= hi  # b == b: not NaN


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise InvalidParam(name, f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidParam(name, f"{name} must be <= {hi}, got {value}")


def _check_num(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise InvalidParam(name, f"{name} must not be NaN")
    if (value <= lo if lo_open else value < lo) or value > hi:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidParam(name, f"{name} must be in {bound}, got {value}")
