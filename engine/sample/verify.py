"""Verification of draft tokens against the target model (speculative decoding; engine/spec/drafts.py).

A speculating row computed its last known token and k drafts d_1..d_k: logits at k + 1 positions, row j
the distribution of the token after d_j (d_0 being the known token). The row emits the longest prefix of
drafts the target agrees with, then one more token from the target: the correction at the first
rejection, or the bonus after the last draft.

Every position is sampled as its request would be with the drafts before it appended (penalties,
min_tokens, grammar masks; engine/sample/draft_positions.py). Greedy rows: the target token at each position
is the sampler's own greedy choice (Sampler.sample on the row's logits, every adjustment included), so the output is token for token that of decoding one token a
step. Sampled rows: rejection sampling with a point-mass draft (the n-gram proposer is deterministic):
accept d_j with probability p_j(d_j), else draw from p_j with d_j removed and renormalised; p_j is the
distribution the sampler draws from (masks, penalties, logit_bias, temperature, top-k, top-p, min-p), so each emitted
token has exactly the non-speculative distribution. Uniforms come from the request's own generator, so
a seeded request reproduces itself (its draws differ from a non-speculative run's: same distribution,
not the same stream).
"""

from __future__ import annotations

import torch

from engine.api import TokenLogprob
from engine.request import Request
from engine.sample.draft_positions import check_grammar, emitted_logprobs, position_views
from engine.sample.sampler import Sampler, filter_probs, inverse_cdf


def accepted_prefix(drafts: list[int], targets: list[int | None]) -> list[int] | None:
    """Greedy verification: targets[j] is the target's token at position j (k + 1 of them, None where
    the row was not finite). The accepted drafts and the correction/bonus token; None if a needed
    target was not finite."""
    out: list[int] = []
    for j, t in enumerate(targets):
        if t is None:
            return None
        out.append(t)
        if j == len(drafts) or t != drafts[j]:
            return out
    return out


def verify_sampled(sampler: Sampler, logits: torch.Tensor, req: Request, drafts: list[int],
                   probs: torch.Tensor | None = None) -> list[int] | None:  # fmt: skip
    """Rejection sampling for one sampled row. logits: [k + 1, vocab] (model dtype), or probs: its
    target_probs. The accepted drafts and the correction/bonus token; None when a distribution used was
    not finite."""
    probs = target_probs(logits, [req] * logits.shape[0]) if probs is None else probs
    g = sampler.generator(req)
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        if torch.isnan(p).any():
            return None
        total = float(p.sum())
        if float(torch.rand(1, generator=g)) * total < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0  # max(0, p - q) for a point mass q at d
        return _then(out, residual, g)
    if torch.isnan(probs[len(drafts)]).any():
        return None
    return _then(out, probs[len(drafts)], g)


def target_probs(logits: torch.Tensor, reqs: list[Request], sampler: Sampler | None = None) -> torch.Tensor:
    """The (unnormalised after filtering) distribution the sampler draws each row's token from (row i:
    reqs[i]'s, a position view for a draft position): grammar mask, penalties, logit_bias and the
    min_tokens ban (Sampler.adjusted), then temperature, softmax, top-k/top-p/min-p. [rows, vocab]
    float32."""
    x = (sampler or Sampler()).adjusted(logits.float().clone(), reqs)
    temp = torch.tensor([r.params.temperature for r in reqs], device=x.device)
    return filter_probs(torch.softmax(x / temp[:, None], dim=-1), reqs)


def _then(out: list[int], p: torch.Tensor, g: torch.Generator) -> list[int] | None:
    """out and one token drawn from p (unnormalised); None when p has no mass (not a finite row)."""
    u = torch.rand(1, generator=g).to(p.device)
    if not float(p.sum()) > 0:
        return None
    return out + [int(inverse_cdf(p[None, :], u)[0])]


def verify_rows(sampler: Sampler, logits: torch.Tensor,
                rows: list) -> tuple[dict[str, list[int] | None], dict[str, list[TokenLogprob]]]:  # fmt: skip
    """rows: (ScheduledRequest with drafts, index of its first row in logits). request_id -> the tokens
    it emits (accepted drafts, then the correction/bonus token), None where its logits were not finite
    (or its grammar refused a token); and request_id -> their logprobs, for requests that asked. Each
    position is sampled as its request would be with the drafts before it appended
    (engine/sample/draft_positions.py); emitted tokens end at one that ends the grammar. The greedy rows'
    targets come from one Sampler.sample call over all their positions."""
    vocab = logits.shape[1]
    plan = [(s, j, position_views(s.request, s.draft_token_ids, vocab)) for s, j in rows]
    out: dict[str, list[int] | None] = {}
    greedy = [p for p in plan if p[0].request.params.greedy]
    if greedy:
        idx = [j + i for _, j, views in greedy for i in range(len(views))]
        targets, _ = sampler.sample(logits[torch.tensor(idx, device=logits.device)], [v for *_, vs in greedy for v in vs])
        at = 0
        for s, _, views in greedy:
            out[s.request.request_id] = accepted_prefix(s.draft_token_ids, targets[at : at + len(views)])
            at += len(views)
    sampled = [p for p in plan if not p[0].request.params.greedy]
    if sampled:  # every sampled row's distributions in one pass
        idx = [j + i for _, j, views in sampled for i in range(len(views))]
        reqs = [v for *_, vs in sampled for v in vs]
        probs = target_probs(logits[torch.tensor(idx, device=logits.device)], reqs, sampler).cpu()
        at = 0
        for s, _, views in sampled:
            out[s.request.request_id] = verify_sampled(sampler, logits, s.request, s.draft_token_ids,
                                                       probs[at : at + len(views)])  # fmt: skip
            at += len(views)
    logprobs: dict[str, list[TokenLogprob]] = {}
    for s, j, _ in plan:
        req = s.request
        tokens = out[req.request_id]
        if tokens is None:
            continue
        tokens = out[req.request_id] = check_grammar(req, tokens)
        if tokens and req.params.logprobs is not None:
            logprobs[req.request_id] = emitted_logprobs(logits[j : j + len(tokens)], tokens, req.params.logprobs)
    return out, logprobs
