"""Log-probabilities of prompt tokens, for requests with `SamplingParams.prompt_logprobs`.

The hidden state at prompt position p predicts token p + 1. A step that runs a chunk [start, end) of
such a request's prompt yields the log-probabilities of the prompt tokens it predicts that are not known
yet (a recompute after preemption does not redo them). Logits are computed `LOGITS_CHUNK` rows at a time
and reduced at once to the chosen token's value and the top-N: a long prompt never holds a
[prompt_len, vocab] tensor (2,048 rows of a 49,152-token vocabulary would be 400 MB in float32).
"""

from __future__ import annotations

import torch

from engine.api import TokenLogprob
from engine.sched.outputs import ScheduledRequest

LOGITS_CHUNK = 256  # rows of logits at once: 256 x 49,152 float32 = 48 MiB


def prompt_positions(s: ScheduledRequest) -> range:
    """Positions of this chunk whose next prompt token's log-probability is still to compute."""
    req = s.request
    if req.params.prompt_logprobs is None:
        return range(0)
    known = max(len(req.prompt_logprobs), 1)  # token 0 has none: it counts as known
    return range(max(s.start, known - 1), min(s.start + s.num_tokens, req.num_prompt_tokens - 1))


def compute_prompt_logprobs(model, hidden: torch.Tensor, items: list[ScheduledRequest]) -> dict[str, list[TokenLogprob]]:
    """hidden: [T, hidden] of the packed step, `items` in packing order. Returns request_id -> the new
    prompt log-probabilities, in prompt order, for the items that want them."""
    out: dict[str, list[TokenLogprob]] = {}
    offset = 0
    for s in items:
        positions = prompt_positions(s)
        if len(positions):
            req = s.request
            rows = torch.arange(positions.start, positions.stop, device=hidden.device) - s.start + offset
            targets = req.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            out[req.request_id] = _logprobs(model, hidden, rows, targets, req.params.prompt_logprobs)
        offset += s.num_tokens
    return out


def _logprobs(model, hidden: torch.Tensor, rows: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    result: list[TokenLogprob] = []
    for i in range(0, len(targets), LOGITS_CHUNK):
        lp = torch.log_softmax(model.compute_logits(hidden[rows[i : i + LOGITS_CHUNK]]).float(), dim=-1)
        want = torch.tensor(targets[i : i + LOGITS_CHUNK], device=lp.device)
        chosen = lp.gather(1, want[:, None])[:, 0].tolist()
        if top_n:
            vals, ids = lp.topk(top_n, dim=-1)
            tops = [list(zip(r_ids, r_vals, strict=True)) for r_ids, r_vals in zip(ids.tolist(), vals.tolist(), strict=True)]
        else:
            tops = [[] for _ in chosen]
        result += [TokenLogprob(t, v, top) for t, v, top in zip(targets[i : i + LOGITS_CHUNK], chosen, tops, strict=True)]
        del lp
    return result
