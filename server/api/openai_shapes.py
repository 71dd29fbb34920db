"""How the OpenAI API lays out completions and chat completions (server/api/respond.py shapes): the
JSON bodies, the stream chunks, log-probabilities in each API's form, echo, usage (each prompt counted
once with n), and each choice's tool-call parser on chat. Choice `index` = prompt index x n + sample.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from sse_starlette import ServerSentEvent

from engine.api import RequestOutput, TokenLogprob
from server.api.respond import ChoiceEvents, json_text
from server.http import sse
from server.prompt.output_reader import OutputReader
from server.prompt.reasoning import ReasoningPlan
from server.prompt.tool_parser import ToolParser
from server.prompt.tools import finish_reason, message_with_calls
from server.serving.deployment import Lease
from server.serving.handle import Completed, Handle
from server.serving.ticket import Finished, Ticket, Tokens


def _event(data: dict[str, Any]) -> ServerSentEvent:
    return sse.event(json.dumps(data, separators=(",", ":"), ensure_ascii=False))


def _error(finished: Finished) -> dict[str, Any]:
    """The OpenAI error object of a request (or choice) that failed."""
    assert finished.error is not None
    error = finished.error
    return {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}


def _marked(choice: dict[str, Any], finished: Finished) -> dict[str, Any]:
    """A choice of several that its queue deadline ended before it started: empty, finish_reason
    `timeout`, and the error it would have been alone (server/api/choices.py collect_choices)."""
    return {**choice, "error": _error(finished)} if finished.never_started else choice


class OpenAIShape:
    """How one endpoint lays out its responses; choice `index` = prompt index x n + sample."""

    object_full = ""
    object_chunk = ""

    def __init__(self, lease: Lease, model: str, request_id: str, n: int, want_logprobs: bool,
                 include_usage: bool) -> None:  # fmt: skip
        self.codec = lease.deployment.codec
        self.model = model
        self.fingerprint = lease.deployment.version  # system_fingerprint: the version that answers
        self.id = request_id
        self.n = n  # samples per prompt
        self.want_logprobs = want_logprobs  # the request asked for sampled tokens' log-probabilities
        self.include_usage = include_usage  # stream_options.include_usage
        self.created = int(time.time())
        self.cached = False  # every choice was answered from the response cache

    # -- the two answers (server/api/respond.py Shape) ------------------------------------------------
    def body(self, handles: list[Handle], done: list[Completed]) -> dict[str, Any]:
        self.cached = all(h.cached for h in handles)
        return self.full(done, self.want_logprobs)

    async def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        """Chunks as OpenAI streams them (a first chunk per choice where the API has one), an error chunk
        that ends the choices' chunks (but for a choice of several that its queue deadline ended before
        it started: its last chunk is marked, the others go on), the usage chunk when asked (and every
        choice finished), then [DONE]."""
        self.cached = all(h.cached for h in handles)
        tickets = [h.ticket for h in handles]
        extra = {"usage": None} if self.include_usage else {}
        finished = 0
        for index in range(len(tickets)):
            first = self.first_chunk(index)
            if first is not None:
                yield _event({**self.chunk([first]), **extra})
        async for index, event in events:
            if isinstance(event, Tokens):
                if event.output.prompt_logprobs is not None:  # echo: the prompt's entries x top-N, off the loop
                    chunk = await asyncio.to_thread(self._tokens_event, index, event.output, extra)
                else:
                    chunk = self._tokens_event(index, event.output, extra)
                if chunk is not None:
                    yield chunk
            elif isinstance(event, Finished):
                if event.error is not None and not (event.never_started and len(tickets) > 1):
                    yield _event({"error": _error(event)})
                    break
                finished += 1  # a choice of several that never started ends alone, marked
                yield _event({**self.chunk([_marked(self.finish_delta(index, event.reason), event)]), **extra})
        if self.include_usage and finished == len(tickets):
            yield _event({**self.chunk([]), "usage": self.usage(tickets)})
        yield sse.event("[DONE]")

    def _tokens_event(self, index: int, out: RequestOutput, extra: dict[str, Any]) -> ServerSentEvent | None:
        """The chunk for one step's output of choice `index`; None when there is nothing to send yet."""
        lps = out.logprobs if self.want_logprobs else None
        choice = self.delta(index, out.text_delta, lps, None, out.prompt_logprobs)
        if choice is None:
            return None
        if out.prompt_logprobs is not None:  # the echo chunk: serialized in pieces (on a worker thread)
            return sse.event(json_text({**self.chunk([choice]), **extra}, allow_nan=True))
        return _event({**self.chunk([choice]), **extra})

    def usage(self, tickets: list[Ticket]) -> dict[str, Any]:
        """Each prompt counts once (OpenAI's rule for n), with its first sample's cached tokens; a prompt
        whose first sample never started (its queue deadline) ran nothing and counts none."""
        firsts = [t for t in tickets[:: self.n] if t.error is None or t.error.kind != "queue_timeout"]
        prompt = sum(len(t.prompt_token_ids) for t in firsts)
        completion = sum(t.completion_tokens for t in tickets)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion,
                                 "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in firsts)}}  # fmt: skip
        if self.cached:
            usage["cached"] = True
        return usage

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def full(self, done: list[Completed], want: bool) -> dict[str, Any]:
        choices = [_marked(self.full_choice(i, d, want), d.finished) for i, d in enumerate(done)]
        return {"id": self.id, "object": self.object_full, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices,
                "usage": self.usage([d.ticket for d in done])}  # fmt: skip

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def delta(self, index: int, text: str, lps: list[TokenLogprob] | None, reason: str | None,
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any] | None:  # fmt: skip
        """A stream choice for one step's text; None: nothing to send for it yet."""
        raise NotImplementedError

    def finish_delta(self, index: int, reason: str) -> dict[str, Any]:
        """The stream's last choice: its finish_reason (and what was held back)."""
        choice = self.delta(index, "", None, reason, None)
        assert choice is not None
        return choice

    def full_choice(self, index: int, done: Completed, want: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _texts(self) -> Callable[[int], str]:
        """token id -> its text, for many lookups: the codec's table indexed directly when it is built."""
        table, fallback = self.codec.text_table(), self.codec.token_text
        if table is None:
            return fallback
        size = len(table)
        return lambda token_id: table[token_id] if 0 <= token_id < size else fallback(token_id)


class CompletionShape(OpenAIShape):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, lease: Lease, model: str, request_id: str, n: int, want_logprobs: bool, include_usage: bool,
                 echo: list[tuple[list[int], str | None]] | None) -> None:  # fmt: skip
        super().__init__(lease, model, request_id, n, want_logprobs, include_usage)
        self.echo = echo  # each prompt's ids and text, when the prompt is echoed
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token (logprobs)
        self._echoed: set[int] = set()  # choices whose stream carried the prompt already

    def delta(self, index: int, text: str, lps: list[TokenLogprob] | None, reason: str | None,
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any]:  # fmt: skip
        if self.echo is not None and index not in self._echoed and reason is None:
            self._echoed.add(index)
            prefix, logprobs = self._echo(index, prompt_lps, lps)
        else:
            prefix, logprobs = "", self._logprobs(index, lps)
        return {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reason}

    def full_choice(self, index: int, done: Completed, want: bool) -> dict[str, Any]:
        lps = done.logprobs if want else None
        if self.echo is not None:
            prefix, logprobs = self._echo(index, done.prompt_logprobs, lps)
        else:
            prefix, logprobs = "", self._logprobs(index, lps)
        return {"index": index, "text": prefix + done.text, "logprobs": logprobs, "finish_reason": done.finished.reason}

    def _echo(self, index: int, prompt_lps: list[TokenLogprob | None] | None,
              lps: list[TokenLogprob] | None) -> tuple[str, dict[str, Any] | None]:  # fmt: skip
        """The prompt's text, and the logprobs of the prompt tokens (the first has none) then of `lps`."""
        assert self.echo is not None
        ids, text = self.echo[index // self.n]
        prompt_text = text if text is not None else self.codec.decode(ids)
        if lps is None:
            return prompt_text, None
        entries = prompt_lps if prompt_lps is not None else [None] * len(ids)
        head = self._logprobs(index, [TokenLogprob(t, float("nan")) if e is None else e
                                      for t, e in zip(ids, entries, strict=False)])  # fmt: skip
        assert head is not None
        for i, e in enumerate(entries[: len(ids)]):
            if e is None:  # no log-probability for it (the first token): null, as OpenAI sends
                head["token_logprobs"][i], head["top_logprobs"][i] = None, None
        tail = self._logprobs(index, lps) or {}
        return prompt_text, {key: head[key] + tail.get(key, []) for key in head}

    def _logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        text = self._texts()
        tokens = [text(lp.token_id) for lp in lps]
        offsets = []
        offset = self._offsets.get(index, 0)
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }


class ChatShape(OpenAIShape):
    """Chat's answer; each choice read by an OutputReader (server/prompt/output_reader.py): with a
    reasoning parser the reasoning goes out as `reasoning` (vLLM's field, in the message and in stream
    deltas) and is counted in usage's `completion_tokens_details.reasoning_tokens`; with tools, calls are
    parsed from the text after it."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, lease: Lease, model: str, request_id: str, n: int, want_logprobs: bool, include_usage: bool,
                 new_parser: Callable[[], ToolParser | None] | None = None,
                 reasoning: ReasoningPlan | None = None) -> None:  # fmt: skip
        super().__init__(lease, model, request_id, n, want_logprobs, include_usage)
        self._new_parser = new_parser  # a tool-call parser per choice (server/prompt/tool_parser.py)
        self._reasoning = reasoning  # how each choice's reasoning is read; None: no reasoning parser
        self._readers: dict[int, OutputReader] = {}  # choice -> its reader

    def _reader(self, index: int) -> OutputReader:
        if index not in self._readers:
            tools = self._new_parser() if self._new_parser is not None else None
            self._readers[index] = OutputReader(self._reasoning, tools)
        return self._readers[index]

    def _plain(self, reader: OutputReader) -> bool:
        """The text is all content: nothing to parse."""
        return self._new_parser is None and not reader.parses_reasoning

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def _tokens_event(self, index: int, out: RequestOutput, extra: dict[str, Any]) -> ServerSentEvent | None:
        self._reader(index).token_ids += out.new_token_ids  # counted for reasoning_tokens
        return super()._tokens_event(index, out, extra)

    def delta(self, index: int, text: str, lps: list[TokenLogprob] | None, reason: str | None,
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any] | None:  # fmt: skip
        reader = self._reader(index)
        if self._plain(reader):
            delta = {"content": text} if reason is None else {}
        else:  # reasoning, content and tool-call pieces as the parsers release them
            piece = reader.feed(text) if reason is None else reader.finish()
            delta = {"reasoning": piece.reasoning} if piece.reasoning else {}
            delta.update(piece.parsed().openai())
            if reason is not None:
                reason = finish_reason(reason, reader.calls)
            elif not delta and lps is None:
                return None
        return {"index": index, "delta": delta, "logprobs": self._logprobs(lps), "finish_reason": reason}

    def full_choice(self, index: int, done: Completed, want: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": done.text}
        reason = done.finished.reason
        reader = self._reader(index)
        if not self._plain(reader):
            piece = reader.read_all(done.text, done.token_ids)
            message, reason = message_with_calls(piece.content, reader.calls), finish_reason(reason, reader.calls)
            if reader.parses_reasoning:  # vLLM's: null when there was none (or it is not returned)
                message["reasoning"] = piece.reasoning or None
                message["content"] = message["content"] or None
        return {"index": index, "message": message, "logprobs": self._logprobs(done.logprobs if want else None),
                "finish_reason": reason}  # fmt: skip

    def usage(self, tickets: list[Ticket]) -> dict[str, Any]:
        usage = super().usage(tickets)
        if self._reasoning is not None:
            spent = sum(r.reasoning_tokens(self.codec.decode) for r in self._readers.values())
            usage["completion_tokens_details"] = {"reasoning_tokens": spent}
        return usage

    def _logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        text = self._texts()
        return {"content": [
            {**_entry(text(lp.token_id), lp.logprob), "top_logprobs": [_entry(text(t), v) for t, v in lp.top]}
            for lp in lps
        ]}  # fmt: skip


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
