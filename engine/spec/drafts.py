"""Speculative decoding, the plain-Python half (no torch): the config, the n-gram prompt-lookup proposer,
which requests may speculate, and the per-request adaptive draft length.

A decode row that speculates runs its last token plus k draft tokens as one short chunk over the paged
KV cache (the scheduler schedules k + 1 tokens); the runner verifies the drafts against the target
model's k + 1 distributions (engine/sample/verify.py) and the request takes the accepted drafts plus one
bonus/correction token. The rejected tail's KV is rolled back by truncating the block table
(`Scheduler.settle_drafts`); prefix-cache hashes only ever cover accepted tokens. See docs/ENGINE.md,
"Speculative decoding".
"""

from __future__ import annotations

from typing import Protocol

from engine.config.speculative import SpeculativeConfig
from engine.request import Request

__all__ = ["NgramProposer", "Proposer", "SpeculativeConfig", "draft_length", "may_speculate", "ngram_propose"]

ACCEPTANCE_EMA = 0.5  # weight of the newest verification in a request's acceptance rate
MAX_LOOKUP_TOKENS = 4096  # the n-gram search looks this far back (prompt + output) at most


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> list[int]:
        """At most k draft tokens to follow req's tokens (prompt + output so far); [] for none."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): the tokens that followed an earlier occurrence of the last n."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, req: Request, k: int) -> list[int]:
        return ngram_propose(req.prompt_token_ids + req.output_token_ids, k, self.n_max, self.n_min)


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens' last n tokens, for the
    longest n in [n_min, n_max] that occurs; [] when none does."""
    length = len(tokens)
    lo = max(0, length - MAX_LOOKUP_TOKENS)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        # a match ends at i + n - 1 < length - 1, so at least one token follows it
        for i in range(length - n - 1, lo - 1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def may_speculate(req: Request) -> bool:
    """Whether req's next token may come with drafts: unless the request opted out. Every sampling
    feature applies at each draft position with the drafts before it (engine/sample/draft_positions.py)."""
    return req.params.speculative


def draft_length(req: Request, k: int) -> int:
    """The request's draft length now: k scaled by its recent acceptance rate, at least 1."""
    return max(1, min(k, round(k * req.spec_acceptance)))


def update_acceptance(req: Request, drafted: int, accepted: int) -> None:
    """Fold one verification (accepted of drafted) into req's acceptance rate."""
    rate = accepted / drafted
    req.spec_acceptance = (1 - ACCEPTANCE_EMA) * req.spec_acceptance + ACCEPTANCE_EMA * rate
