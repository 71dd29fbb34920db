"""A small stand-in for `engine.Engine` with the same public API, for server tests that need control
the real engine does not give (slow or gated steps, a step that raises). Imports no torch.

Tokens are bytes shifted by 3 (ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>); request k-th
output token is a lowercase letter chosen from the prompt, so outputs are deterministic.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from engine.outputs import EngineStats, FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 2
OFFSET = len(SPECIALS)
VOCAB = 256 + OFFSET


class FakeTokenizer:
    """Byte-level tokenizer with a ChatML template; the subset of PreTrainedTokenizerFast we use."""

    eos_token_id = EOS_ID
    chat_template = "chatml"

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        rest = text
        while rest:
            special = next((s for s in SPECIALS if rest.startswith(s)), None)
            if special is not None:
                out.append(SPECIALS.index(special))
                rest = rest[len(special) :]
            else:
                out.extend(b + OFFSET for b in rest[0].encode())
                rest = rest[1:]
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        specials = "".join(SPECIALS[i] for i in ids if i < OFFSET and not skip_special_tokens)
        return specials + bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True):
        text = "".join(f"<|im_start|>{m['role']}\n{_content(m)}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content or ""


class FakeRunner:
    """`execute` is what tests monkeypatch to inject a fault; it returns nothing useful."""

    def execute(self, batch: list[str]) -> int:
        return len(batch)


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    output: list[int] = field(default_factory=list)
    text: str = ""


class FakeEngine:
    """Same methods and attributes as engine.Engine; one token per running request per step."""

    def __init__(
        self,
        max_model_len: int = 512,
        max_num_seqs: int = 8,
        block_size: int = 4,
        num_blocks: int = 1024,
        step_delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.dtype_name = "float32"
        self.device_name = "cpu"
        self.runner = FakeRunner()
        self.step_delay_s = step_delay_s
        self.step_gate = threading.Event()  # cleared: step() waits (tests hold the engine mid-step)
        self.step_gate.set()
        self._max_num_seqs = max_num_seqs
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._ids: set[str] = set()
        self._steps = 0
        self._generated = 0
        self._last_step_s = 0.0
        self._owner: int | None = None  # the one thread allowed to call step/add/abort

    # -- the API ------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> int:
        self._check_thread()
        params = params or SamplingParams()
        if request_id in self._ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt or "")
        if not ids:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < VOCAB for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {VOCAB})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len ({self.max_model_len})")
        self._ids.add(request_id)
        self._waiting.append(_Req(request_id, ids, params, priority, arrival_time or time.monotonic()))
        return len(ids)

    def abort(self, request_id: str) -> bool:
        self._check_thread()
        for queue in (self._waiting, self._running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._ids.discard(request_id)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        self.step_gate.wait()
        start = time.monotonic()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._schedule()
        batch = list(self._running)
        try:
            self.runner.execute([r.request_id for r in batch])
        except Exception as exc:  # the real engine's contract: fail the step's requests, keep serving
            return [self._fail(req, exc) for req in batch]
        outputs = [self._advance(req) for req in batch]
        self._steps += 1
        self._last_step_s = time.monotonic() - start
        return outputs

    def stats(self) -> EngineStats:
        used = sum(self._blocks(r) for r in self._running)
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_blocks_used=used,
            kv_blocks_total=self._num_blocks,
            generation_tokens=self._generated,
            last_step_time_s=self._last_step_s,
            steps=self._steps,
        )

    # -- internals ----------------------------------------------------------------------------
    def _check_thread(self) -> None:
        # The real engine is not thread-safe: catch a server that calls it from two threads.
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError("FakeEngine used from two threads")

    def release_thread(self) -> None:
        """Let another thread own the engine (a test reusing it after its server stopped)."""
        self._owner = None

    def _blocks(self, req: _Req) -> int:
        return math.ceil((len(req.prompt) + len(req.output)) / self._block_size)

    def _schedule(self) -> None:
        self._waiting.sort(key=lambda r: (r.priority, r.arrival))
        while self._waiting and len(self._running) < self._max_num_seqs:
            self._running.append(self._waiting.pop(0))

    def _token(self, req: _Req) -> int:
        return OFFSET + ord("a") + (sum(req.prompt) + 7 * len(req.output)) % 26

    def _advance(self, req: _Req) -> RequestOutput:
        token = self._token(req)
        req.output.append(token)
        self._generated += 1
        delta = self.tokenizer.decode([token])
        req.text += delta
        params = req.params
        reason = None
        if len(req.output) >= params.min_tokens and token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif any(s in req.text for s in params.stop):
            reason, delta = FinishReason.STOP, ""
        elif len(req.output) >= params.max_tokens:
            reason = FinishReason.LENGTH
        logprobs = None
        if params.logprobs is not None:
            top = [(token, -0.5), (token + 1, -1.5)][: params.logprobs]
            logprobs = [TokenLogprob(token_id=token, logprob=-0.5, top=top)]
        if reason is not None:
            self._running.remove(req)
            self._ids.discard(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            text_delta=delta,
            logprobs=logprobs,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output),
            cached_tokens=0,
        )

    def _fail(self, req: _Req, exc: Exception) -> RequestOutput:
        self._running.remove(req)
        self._ids.discard(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            text_delta="",
            logprobs=None,
            finished=True,
            finish_reason=FinishReason.ERROR,
            prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output),
            cached_tokens=0,
            error=f"{type(exc).__name__}: {exc}",
        )
