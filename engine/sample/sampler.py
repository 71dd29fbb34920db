"""Batched sampling with per-request parameters.

Greedy rows take the argmax. Sampled rows are scaled by temperature, filtered by top-k, top-p and
min-p, then drawn by inverse CDF: one uniform u per row from the request's own generator picks the
first token whose cumulative probability exceeds u x the row's total, so a seeded request draws the
same tokens whatever else is in the batch. One draw per row, not one per vocabulary entry: the
exponential race (argmax of p / E over a full row of Exp(1) noise) cost 26 ms a step at 32 rows of a
49k vocabulary on one CPU core, the inverse CDF in PyTorch about 5 ms, and on the CPU the C++ kernel
(torch.ops.tokenmill.sample_rows: greedy and unfiltered rows, two passes per row) under 1 ms.
Logprobs are those of the model's raw distribution (before penalties, logit_bias and temperature).
A request's logit_bias becomes a dense row once, on its first step (kept on the request); the biased rows
of a step get their bias matrix in one index_add_, the matrix rebuilt only when the biased requests or
their rows change: a full-vocabulary bias costs no Python work per step.
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
    def __init__(self, seed: int = 0, rows_kernel: bool = False) -> None:
        self._seeder = torch.Generator().manual_seed(seed)  # seeds requests that give none
        # torch.ops.tokenmill.sample_rows is loaded and the logits are on the CPU: greedy and
        # unfiltered rows take it (the draw from the same uniform, to rounding), the others PyTorch.
        self._rows_kernel = rows_kernel
        # the last step's biased rows: ((row, request id) pairs, row indices [k], their bias rows [k, vocab])
        self._bias_batch: tuple[tuple[tuple[int, str], ...], torch.Tensor, torch.Tensor] | None = None

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

    def adjusted(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The scores each row is drawn from before temperature: grammar masks, penalties, logit_bias and
        the min_tokens ban applied, as `sample` applies them. float32 [N, vocab]; may write into float32
        `logits` (pass a copy). Speculative verification uses it (engine/sample/verify.py)."""
        constrained = [i for i, r in enumerate(reqs) if r.params.structured is not None]
        return self._apply_penalties(self._masked(logits, reqs, constrained), reqs).float()

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
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_lp = torch.log_softmax(raw.float(), dim=-1) if any(want_lp) else None
        logits = self._apply_penalties(logits, reqs)
        fast = [i for i, r in enumerate(reqs) if self._rows_kernel and (r.params.greedy or not _filters(r))]
        if len(fast) == len(reqs):  # the common case: no row copies
            tokens, chosen = self._kernel_rows(logits, reqs)
        else:
            tokens = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
            chosen = torch.empty(len(reqs), device=logits.device)  # score of each chosen token: finite if sound
            kept = set(fast)
            slow = [i for i in range(len(reqs)) if i not in kept]
            for rows, fn in ((fast, self._kernel_rows), (slow, self._torch_rows)):
                if rows:
                    idx = torch.tensor(rows, device=logits.device)
                    tokens[idx], chosen[idx] = fn(logits[idx], [reqs[i] for i in rows])
        token_list = _finite_or_none(tokens, chosen)
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if want_lp[i] and token_list[i] is not None:
                lps[i] = token_logprob(raw_lp[i], token_list[i], r.params.logprobs)
        return token_list, lps

    def _kernel_rows(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy and unfiltered sampled rows in one C++ call (engine/kernels/csrc/cpu_sampling.cpp): tokens [n]
        and their scores [n] (max logit or probability; not finite where the row was not)."""
        inv_t = torch.tensor([0.0 if r.params.greedy else 1.0 / r.params.temperature for r in reqs])
        u = torch.cat([torch.zeros(1) if r.params.greedy else self._uniform(r) for r in reqs])
        return torch.ops.tokenmill.sample_rows(logits, inv_t, u)

    def _torch_rows(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in PyTorch (any device, and the rows top-k, top-p or min-p filter)."""
        logits = logits.float()
        tokens = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
        chosen = torch.empty(len(reqs), device=logits.device)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
            chosen[idx] = logits[idx].gather(1, tokens[idx][:, None])[:, 0]
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            tokens[idx], chosen[idx] = self._sample_random(logits[idx], [reqs[i] for i in rand])
        return tokens, chosen

    def _uniform(self, req: Request) -> torch.Tensor:
        """One draw in [0, 1) from req's own generator: [1] (CPU)."""
        return torch.rand(1, generator=self.generator(req))

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logits unchanged when no row needs penalties, else a float32 copy with them applied."""
        rows = [i for i, r in enumerate(reqs) if _needs_processing(r)]
        if not rows:
            return logits
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()  # a copy either way
        for i in rows:
            _penalise_row(logits[i], reqs[i])
        self._add_bias(logits, reqs, [i for i in rows if reqs[i].params.logit_bias])
        for i in rows:
            _ban_until_min_tokens(logits[i], reqs[i])
        return logits

    def _add_bias(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
        """OpenAI's logit_bias, added to the logits before temperature (logits: [N, vocab] float32, in place):
        the biased rows' bias matrix, kept while the same requests hold the same rows (a decode batch
        changes rarely), added in one op: a slice add when the rows are adjacent (a request's n samples
        are), else an accumulating index_put_. Not index_add_: with 2 intra-op threads on a busy 2-core
        host it took 22 ms for 8 full-vocabulary rows, against 0.04 ms for the slice add."""
        if not rows:
            return
        key = tuple((i, reqs[i].request_id) for i in rows)
        if self._bias_batch is None or self._bias_batch[0] != key or self._bias_batch[2].device != logits.device:
            vocab, dev = logits.shape[1], logits.device
            matrix = torch.stack([_bias_row(reqs[i], vocab, dev) for i in rows])  # [len(rows), vocab]
            self._bias_batch = (key, torch.tensor(rows, device=dev), matrix)
        _, index, matrix = self._bias_batch
        if rows[-1] - rows[0] == len(rows) - 1:  # adjacent (rows are in increasing order)
            logits[rows[0] : rows[-1] + 1].add_(matrix)
        else:
            logits.index_put_((index,), matrix, accumulate=True)

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drawn tokens [n] and their probabilities [n] (NaN where the row was not finite)."""
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        probs = torch.softmax(logits / temp[:, None], dim=-1)  # [n, vocab]
        probs = filter_probs(probs, reqs)
        # One uniform per request from its own generator (CPU), so batches don't change draws.
        u = torch.cat([self._uniform(r) for r in reqs]).to(dev)
        drawn = inverse_cdf(probs, u)
        p = probs.gather(1, drawn[:, None])[:, 0]
        return drawn, torch.where(p > 0, p, float("nan"))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [n, vocab] (not necessarily normalised), u: [n] in [0, 1). The first index whose running
    sum exceeds u x the row's sum, so a zero-probability token is never drawn: [n] long. A row with NaN
    gives some index in range; its probability there is NaN and the caller marks the row."""
    cdf = probs.cumsum(dim=-1)  # float32: the running sum's rounding is ~1e-5 of the mass at 49k entries
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # Rounding can put u x total at the total itself: take the last token with mass instead.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(drawn, last).clamp_(max=probs.shape[1] - 1)[:, 0]


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
    """Repetition, presence and frequency penalties, in place on one float32 row."""
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


def _bias_row(r: Request, vocab: int, device: torch.device) -> torch.Tensor:
    """r's logit_bias as a dense [vocab] float32 row on `device` (0 where it names no token), built once and
    kept on r. Dense whatever its size: one row per running request at most (waiting requests have none
    yet), and a batch of rows is then one tensor."""
    if r.bias is None or r.bias.device != device or r.bias.shape[0] != vocab:
        pairs = r.params.logit_bias
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
        values = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
        r.bias = torch.zeros(vocab, dtype=torch.float32, device=device).index_put_((ids,), values)
    return r.bias


def _ban_until_min_tokens(row: torch.Tensor, r: Request) -> None:
    """Before min_tokens, EOS (unless ignored) and stop_token_ids cannot be drawn: -inf, in place."""
    p, dev = r.params, row.device
    if r.num_output_tokens < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        banned = [t for t in banned if t < row.shape[0]]
        if banned:
            row[torch.tensor(banned, device=dev)] = float("-inf")


def _filters(r: Request) -> bool:
    """Whether top-k, top-p or min-p can exclude tokens from r's draws."""
    p = r.params
    return p.top_k != 0 or p.top_p < 1.0 or p.min_p != 0.0


def filter_probs(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude. probs: [n, vocab]."""
    if not any(_filters(r) for r in reqs):
        return probs
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
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


def token_logprob(lp_row: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = lp_row.topk(top_n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token, float(lp_row[token]), top)
