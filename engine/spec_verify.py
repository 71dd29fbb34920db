"""Verification of draft tokens against the target model (speculative decoding; engine/speculative.py).

A speculating row computed its last known token and k drafts d_1..d_k: logits at k + 1 positions, row j
the distribution of the token after d_j (d_0 being the known token). The row emits the longest prefix of
drafts the target agrees with, then one more token from the target: the correction at the first
rejection, or the bonus after the last draft.

Greedy rows: the target token at each position is the sampler's own greedy choice (Sampler.sample on
the row's logits, logit_bias included), so the output is token for token that of decoding one token a
step. Sampled rows: rejection sampling with a point-mass draft (the n-gram proposer is deterministic):
accept d_j with probability p_j(d_j), else draw from p_j with d_j removed and renormalised; p_j is the
distribution the sampler draws from (logit_bias, temperature, top-k, top-p, min-p), so each emitted
token has exactly the non-speculative distribution. Uniforms come from the request's own generator, so
a seeded request reproduces itself (its draws differ from a non-speculative run's: same distribution,
not the same stream).
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import Sampler, _filter, _inverse_cdf


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


def target_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The (unnormalised after filtering) distribution the sampler draws each row's token from (row i:
    reqs[i]'s): logit_bias added, then temperature, softmax, top-k/top-p/min-p. [rows, vocab] float32."""
    x = logits.float().clone()
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            ids = torch.tensor([t for t, _ in r.params.logit_bias], device=x.device)
            x[i, ids] += torch.tensor([b for _, b in r.params.logit_bias], device=x.device)
    temp = torch.tensor([r.params.temperature for r in reqs], device=x.device)
    return _filter(torch.softmax(x / temp[:, None], dim=-1), reqs)


def _then(out: list[int], p: torch.Tensor, g: torch.Generator) -> list[int] | None:
    """out and one token drawn from p (unnormalised); None when p has no mass (not a finite row)."""
    u = torch.rand(1, generator=g).to(p.device)
    if not float(p.sum()) > 0:
        return None
    return out + [int(_inverse_cdf(p[None, :], u)[0])]


def verify_rows(sampler: Sampler, logits: torch.Tensor, rows: list) -> dict[str, list[int] | None]:
    """rows: (ScheduledRequest with drafts, index of its first row in logits). request_id -> the tokens
    it emits (accepted drafts, then the correction/bonus token), None where its logits were not finite.
    The greedy rows' targets come from one Sampler.sample call over all their positions."""
    out: dict[str, list[int] | None] = {}
    greedy = [(s, j) for s, j in rows if s.request.params.greedy]
    if greedy:
        idx = [j + i for s, j in greedy for i in range(len(s.draft_token_ids) + 1)]
        reqs = [s.request for s, _ in greedy for _ in range(len(s.draft_token_ids) + 1)]
        targets, _ = sampler.sample(logits[torch.tensor(idx, device=logits.device)], reqs)
        at = 0
        for s, _ in greedy:
            n = len(s.draft_token_ids) + 1
            out[s.request.request_id] = accepted_prefix(s.draft_token_ids, targets[at : at + n])
            at += n
    sampled = [(s, j) for s, j in rows if not s.request.params.greedy]
    if sampled:  # every sampled row's distributions in one pass
        idx = [j + i for s, j in sampled for i in range(len(s.draft_token_ids) + 1)]
        reqs = [s.request for s, _ in sampled for _ in range(len(s.draft_token_ids) + 1)]
        probs = target_probs(logits[torch.tensor(idx, device=logits.device)], reqs).cpu()
        at = 0
        for s, _ in sampled:
            n = len(s.draft_token_ids) + 1
            out[s.request.request_id] = verify_sampled(sampler, logits, s.request, s.draft_token_ids,
                                                       probs[at : at + n])  # fmt: skip
            at += n
    return out
