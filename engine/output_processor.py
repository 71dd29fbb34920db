"""Turns sampled tokens into RequestOutputs: stop checks, detokenization, stop strings."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from engine.outputs import FinishReason, RequestOutput, TokenLogprob
from engine.request import Request


class RequestTextState:
    """Per-request text state, kept across preemptions."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringFilter(stops)


def token_finish_reason(req: Request, token: int, max_model_len: int) -> FinishReason | None:
    """Finish reason implied by the token just appended to req (stop strings are checked later)."""
    p = req.params
    if not p.ignore_eos and token in req.eos_token_ids:
        return FinishReason.STOP
    if token in p.stop_token_ids:
        return FinishReason.STOP
    if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def make_output(
    req: Request, state: RequestTextState, token: int, logprob: TokenLogprob | None, max_model_len: int
) -> RequestOutput:
    """Append token to req and describe the step. Sets req.finish_reason when it finished."""
    req.output_token_ids.append(token)
    reason = token_finish_reason(req, token, max_model_len)
    delta = state.detok.add([token], final=reason is not None)
    text, hit = state.stops.feed(delta, final=reason is not None)
    if hit:
        reason = FinishReason.STOP
    req.finish_reason = reason
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=[token],
        text_delta=text,
        logprobs=[logprob] if logprob is not None else None,
        finished=reason is not None,
        finish_reason=reason,
        prompt_tokens=req.num_prompt_tokens,
        completion_tokens=req.num_output_tokens,
        cached_tokens=max(req.num_cached_tokens, 0),
        kv_blocks=len(req.block_ids),
    )


def error_output(req: Request, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=[],
        text_delta="",
        logprobs=None,
        finished=True,
        finish_reason=FinishReason.ERROR,
        prompt_tokens=req.num_prompt_tokens,
        completion_tokens=req.num_output_tokens,
        cached_tokens=max(req.num_cached_tokens, 0),
        error=message,
        kv_blocks=len(req.block_ids),
    )
