"""Batched sampling with per-request parameters.

Greedy rows take the argmax. Sampled rows are scaled by temperature, filtered by top-k, top-p and
min-p, then drawn with the exponential-race trick (argmax of p / E, E ~ Exp(1)) using each
request's own generator, so a seeded request draws the same tokens whatever else is in the batch.
Logprobs are those of the model's raw distribution (before penalties, logit_bias and temperature).
A row whose chosen score is not finite (NaN or inf logits) yields no token (None): the engine fails
that request alone instead of emitting whatever index argmax picks from NaNs.

Rows of requests with a grammar (`params.structured`) are masked first: their matcher (on the request,
written here only) fills the step's token bitmask, forbidden tokens get -inf, and the matcher advances
past the token drawn. Other rows are not touched, so they sample bit for bit as without those requests.
"""

from __future__ import annotations

import logging

import torch

from engine.api import TokenLogprob
from engine.request import Request
from engine.structured.masks import apply_bitmask, new_bitmask

log = logging.getLogger("tokenmill.engine")


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seeder = torch.Generator().manual_seed(seed)  # seeds requests that give none

    def generator(self, req: Request) -> torch.Generator:
        """req's own generator (created on first use, kept on the request across preemptions)."""
        if req.generator is None:
            seed = req.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeder))
            req.generator = torch.Generator().manual_seed(seed % 2**64)
        return req.generator

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """logits: [N, vocab] (model dtype), one row per request in reqs. Returns tokens (None where the
        row was not finite) and logprobs."""
        constrained = [i for i, r in enumerate(reqs) if r.params.structured is not None]
        tokens, lps = self._sample(self._masked(logits, reqs, constrained), logits, reqs)
        for i in constrained:
            if tokens[i] is not None and not reqs[i].grammar.accept(tokens[i]):
                log.error("request %s: the grammar refused token %d it allowed", reqs[i].request_id, tokens[i])
                tokens[i] = None  # fails this request alone, as a non-finite row does
        return tokens, lps

    def _masked(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> torch.Tensor:
        """logits as float32 with rows' forbidden tokens at -inf. In place on float32 logits unless a
        request wants logprobs (they are the model's: `raw` must stay as it was)."""
        if not rows:
            return logits
        bitmask = new_bitmask(len(reqs), logits.shape[1])  # rows of unconstrained requests stay unused
        for i in rows:
            req = reqs[i]
            if req.grammar is None:
                req.grammar = req.params.structured.compiled.matcher()
            req.grammar.fill_bitmask(bitmask, i)
        masked = logits.float()
        if masked is logits and any(r.params.logprobs is not None for r in reqs):
            masked = masked.clone()
        apply_bitmask(masked, bitmask, rows)
        return masked

    def _sample(self, logits: torch.Tensor, raw: torch.Tensor,
                reqs: list[Request]) -> tuple[list[int | None], list[TokenLogprob | None]]:  # fmt: skip
        """logits: [N, vocab] after masks; raw: the model's (logprobs are of its distribution)."""
        if all(r.params.greedy and r.params.logprobs is None and not _needs_processing(r) for r in reqs):
            # Plain greedy batch. The upcast is exact and pays for itself: on CPU, argmax over bf16
            # runs about 4x slower than the copy plus a float32 argmax (bench-135m, 32 x 49152).
            scores = logits.float()
            best = scores.argmax(dim=-1)
            return _finite_or_none(best, scores.gather(1, best[:, None])[:, 0]), [None] * len(reqs)
        logits = logits.float()
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_lp = torch.log_softmax(raw.float(), dim=-1) if any(want_lp) else None
        logits = self._apply_penalties(logits, reqs)
        tokens = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
        chosen = torch.empty(len(reqs), device=logits.device)  # score of each chosen token: finite if sound
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
            chosen[idx] = logits[idx].gather(1, tokens[idx][:, None])[:, 0]
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            tokens[idx], chosen[idx] = self._sample_random(logits[idx], [reqs[i] for i in rand])
        token_list = _finite_or_none(tokens, chosen)
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if want_lp[i] and token_list[i] is not None:
                lps[i] = _logprob(raw_lp[i], token_list[i], r.params.logprobs)
        return token_list, lps

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if _needs_processing(r)]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            _penalise_row(logits[i], reqs[i])
        return logits

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drawn tokens [n] and their probabilities [n] (NaN where the row was not finite)."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        probs = torch.softmax(logits / temp[:, None], dim=-1)  # [n, vocab]
        probs = _filter(probs, reqs)
        # One noise row per request from its own generator (CPU), so batches don't change draws.
        noise = torch.stack([torch.empty(probs.shape[1]).exponential_(generator=self.generator(r)) for r in reqs])
        drawn = (probs / noise.to(dev)).argmax(dim=-1)
        p = probs.gather(1, drawn[:, None])[:, 0]
        return drawn, torch.where(p > 0, p, float("nan"))


def _finite_or_none(tokens: torch.Tensor, chosen: torch.Tensor) -> list[int | None]:
    """Token ids, None where the chosen score is NaN or inf. One device-to-host copy per step."""
    marked = torch.where(torch.isfinite(chosen), tokens, -1).tolist()
    return [t if t >= 0 else None for t in marked]


def _needs_processing(r: Request) -> bool:
    p = r.params
    min_tok = r.num_output_tokens < p.min_tokens
    penalties = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    return min_tok or penalties or bool(p.logit_bias)


def _penalise_row(row: torch.Tensor, r: Request) -> None:
    p, dev = r.params, row.device
    if p.repetition_penalty != 1.0:
        # As transformers: over prompt and output tokens, shrink positive logits, grow negative ones.
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), device=dev)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        # As OpenAI: over output tokens only.
        ids, counts = torch.tensor(r.output_token_ids, device=dev).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    if p.logit_bias:  # OpenAI's logit_bias: added to the logits, before temperature
        ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
        row[ids] += torch.tensor([b for _, b in p.logit_bias], device=dev, dtype=row.dtype)
    if r.num_output_tokens < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        banned = [t for t in banned if t < row.shape[0]]
        if banned:
            row[torch.tensor(banned, device=dev)] = float("-inf")


def _filter(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude. probs: [n, vocab]."""
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m == 0 for m in min_p):
        return probs
    dev, vocab = probs.device, probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
    keep &= torch.arange(vocab, device=dev)[None, :] < k[:, None]
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    tp = torch.tensor(top_p, device=dev)
    keep &= (sorted_p.cumsum(dim=-1) - sorted_p) < tp[:, None]
    mp = torch.tensor(min_p, device=dev)
    keep &= sorted_p >= mp[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return probs * mask


def _logprob(lp_row: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = lp_row.topk(top_n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token, float(lp_row[token]), top)
