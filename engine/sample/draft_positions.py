"""Each draft position of a speculating row as the sampler must see it (speculative decoding;
engine/sample/verify.py).

Position j of a row with drafts d_1..d_k predicts the token after d_j, so every sampling feature that
depends on the tokens before it sees req's output followed by d_1..d_j: repetition, presence and
frequency penalties count the drafts, a pending min_tokens counts them too, and a grammar's mask is
the matcher's after accepting them. A `position_view` is a shallow copy of the request with that
output (its generator, bias row and params are the request's own objects); for a grammar the real
matcher walks the drafts once, each position's mask is kept as a `MaskSnapshot`, and the matcher is
rolled back. `check_grammar` cuts the emitted tokens at one that ends the grammar; the engine core
advances the matcher as it appends them.
"""

from __future__ import annotations

import copy
import logging

import torch

from engine.api import TokenLogprob
from engine.request import Request
from engine.sample.sampler import token_logprob
from engine.structured.masks import new_bitmask

log = logging.getLogger("tokenmill.engine")


class MaskSnapshot:
    """A GrammarMatcher stand-in frozen at one draft position: it fills its row with the mask taken
    there and never advances (Sampler.sample's accept only checks the token against that mask)."""

    def __init__(self, words: torch.Tensor, nothing: bool) -> None:
        self.words = words.clone()  # int32 [ceil(vocab / 32)]
        self.nothing = nothing

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.words)

    def allows_nothing(self) -> bool:
        return self.nothing

    def accept(self, token_id: int) -> bool:
        return bool((int(self.words[token_id // 32]) >> (token_id % 32)) & 1)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        return None


def needs_views(req: Request) -> bool:
    """Whether req's distribution at a draft position depends on the drafts before it."""
    p = req.params
    penalties = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    return penalties or req.num_output_tokens < p.min_tokens or p.structured is not None


def position_views(req: Request, drafts: list[int], vocab_size: int) -> list[Request]:
    """k + 1 requests for the row's k + 1 positions: view j is req with drafts[:j] appended to its
    output (and, with a grammar, the mask after them). req itself k + 1 times when nothing depends on
    the drafts."""
    if not needs_views(req):
        return [req] * (len(drafts) + 1)
    masks = grammar_snapshots(req, drafts, vocab_size) if req.params.structured is not None else None
    views = []
    for j in range(len(drafts) + 1):
        v = copy.copy(req)
        v.output_token_ids = req.output_token_ids + drafts[:j]
        if masks is not None:
            v.grammar = masks[j]
        views.append(v)
    return views


def grammar_snapshots(req: Request, drafts: list[int], vocab_size: int) -> list[MaskSnapshot]:
    """The grammar's mask at each of the k + 1 positions: the matcher accepts the drafts one by one,
    each mask is kept, then it is rolled back to where it was. Past a draft the grammar refuses (or a
    stop token that ends it) the last mask repeats: those positions are never emitted, as the refused
    draft is masked at its own position and so always rejected."""
    if req.grammar is None:
        req.grammar = req.params.structured.compiled.matcher()
    m = req.grammar
    bitmask = new_bitmask(len(drafts) + 1, vocab_size)
    masks: list[MaskSnapshot] = []
    advanced = 0
    for j in range(len(drafts) + 1):
        if masks and m.is_terminated():
            break
        m.fill_bitmask(bitmask, j)
        masks.append(MaskSnapshot(bitmask[j], m.allows_nothing()))
        if j == len(drafts) or not m.accept(drafts[j]):
            break
        advanced += 1
    if advanced:
        m.rollback(advanced)
        if masks[-1].nothing:  # the matcher's dead-end flag is the last fill's: take it at its own state again
            m.fill_bitmask(new_bitmask(1, vocab_size), 0)
    return masks + [masks[-1]] * (len(drafts) + 1 - len(masks))


def check_grammar(req: Request, tokens: list[int]) -> list[int] | None:
    """A verified row's emitted tokens as its grammar takes them: up to one that ends the grammar; None
    when the grammar refuses one (it should not: each was chosen under its position's mask). The
    matcher is left where it was: the engine core advances it token by token as it appends them, so a
    finish is seen at the token that ended the grammar, not before."""
    if req.params.structured is None or req.grammar is None:
        return tokens
    m, taken = req.grammar, 0
    out: list[int] | None = tokens
    for i, t in enumerate(tokens):
        if not m.accept(t):
            log.error("request %s: the grammar refused verified token %d", req.request_id, t)
            out = None
            break
        taken += 1
        if m.is_terminated():
            out = tokens[: i + 1]
            break
    if taken:
        m.rollback(taken)
    return out


def emitted_logprobs(raw: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of a row's emitted tokens, each from the model's raw distribution at its position (as
    the sampler reports them: before penalties, bias and temperature). raw: [>= len(tokens), vocab]."""
    lp = torch.log_softmax(raw[: len(tokens)].float(), dim=-1)
    return [token_logprob(lp[i], t, top_n) for i, t in enumerate(tokens)]
