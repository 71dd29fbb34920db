"""Turns a step's results into RequestOutputs: token appends, stop checks, detokenization, stop strings,
and the outputs of requests that started, timed out or failed. Writes `Request.output_token_ids`,
`Request.text` and `Request.prompt_logprobs` (no other module does)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.api import Deadline, FinishReason, RequestOutput, TokenLogprob
from engine.request import Request
from engine.text.detokenizer import IncrementalDetokenizer, StopStringFilter


class RequestTextState:
    """Per-request text state, kept across preemptions (on `Request.text`)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringFilter(stops)


def token_finish_reason(req: Request, token: int, max_model_len: int) -> FinishReason | None:
    """Finish reason implied by the token just appended to req (stop strings are checked later)."""
    p = req.params
    if not p.ignore_eos and token in req.eos_token_ids:
        return FinishReason.STOP
    if token in p.stop_token_ids:
        return FinishReason.STOP
    if req.grammar is not None and req.grammar.is_terminated():  # it took a stop token where it may end
        return FinishReason.STOP
    if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def token_output(req: Request, token: int, logprob: TokenLogprob | None, max_model_len: int,
                 started: bool) -> RequestOutput:  # fmt: skip
    """Append token to req and describe the step. Sets req.finish_reason when it finished."""
    req.output_token_ids.append(token)
    reason = token_finish_reason(req, token, max_model_len)
    state: RequestTextState = req.text
    delta = state.detok.add([token], final=reason is not None)
    text, hit = state.stops.feed(delta, final=reason is not None)
    if hit:
        reason = FinishReason.STOP
    req.finish_reason = reason
    prompt_lps = _prompt_logprobs(req) if req.num_output_tokens == 1 else None  # with the first token only
    return _output(req, [token], text, [logprob] if logprob is not None else None, reason, started=started,
                   prompt_logprobs=prompt_lps)  # fmt: skip


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One step's outputs of one request (several tokens: speculative decoding) as one."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return replace(
        last,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        text_delta="".join(o.text_delta for o in outs),
        logprobs=None if any(o.logprobs is None for o in outs) else [lp for o in outs for lp in o.logprobs or []],
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
    )


def add_prompt_logprobs(req: Request, new: list[TokenLogprob] | None) -> None:
    """Append the prompt log-probabilities a step computed (the list starts with the first token's None)."""
    if not new:
        return
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)
    req.prompt_logprobs.extend(new)


def prompt_only_output(req: Request, started: bool) -> RequestOutput:
    """A max_tokens 0 request whose prompt ran: it ends (length) with its prompt log-probabilities."""
    req.finish_reason = FinishReason.LENGTH
    return _output(req, [], "", None, FinishReason.LENGTH, started=started, prompt_logprobs=_prompt_logprobs(req))


def _prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
    if req.params.prompt_logprobs is None:
        return None
    return list(req.prompt_logprobs) if req.prompt_logprobs else [None]  # a 1-token prompt: only the None


def started_output(req: Request) -> RequestOutput:
    """A request scheduled for the first time whose prompt is not done yet (no token this step)."""
    return _output(req, [], "", None, None, started=True)


def timeout_output(req: Request, deadline: Deadline) -> RequestOutput:
    """A request ended by a deadline (as with an abort, text held back for a stop string is dropped)."""
    return _output(req, [], "", None, FinishReason.TIMEOUT, deadline=deadline)


def error_output(req: Request, message: str, started: bool = False, param: str | None = None) -> RequestOutput:
    """A request that failed (`started`: in the step that first scheduled it; `param`: the request's field
    at fault when the request, not the engine, is the cause)."""
    out = _output(req, [], "", None, FinishReason.ERROR, started=started, error=message)
    out.error_param = param
    return out


def _output(req: Request, tokens: list[int], text: str, logprobs: list[TokenLogprob] | None,
            reason: FinishReason | None, started: bool = False, deadline: Deadline | None = None,
            error: str | None = None, prompt_logprobs: list[TokenLogprob | None] | None = None,
            ) -> RequestOutput:  # fmt: skip
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=tokens,
        text_delta=text,
        logprobs=logprobs,
        finished=reason is not None,
        finish_reason=reason,
        prompt_tokens=req.num_prompt_tokens,
        completion_tokens=req.num_output_tokens,
        cached_tokens=max(req.num_cached_tokens, 0),
        error=error,
        kv_blocks=len(req.block_ids) - req.num_freed_blocks,
        started=started,
        num_preemptions=req.num_preemptions,
        deadline=deadline,
        prompt_logprobs=prompt_logprobs,
    )
