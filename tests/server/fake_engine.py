"""A torch-free engine for server tests: the real `StepLoop` (scheduler, block manager, deadlines,
outputs) over a made-up model. `FakeRunner` "samples" a token from the request's tokens, so outputs
are deterministic; tests replace `runner.execute` to inject faults, hold `step_gate` to freeze the
engine, or set `step_delay_s` to slow it down.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from engine.api import RequestOutput
from engine.core.step_loop import StepLoop
from engine.kv.block_manager import BlockManager
from engine.kv.events import KVEventSink
from engine.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine.sched.scheduler import SchedulerConfig

if TYPE_CHECKING:
    from engine.api import EngineProtocol

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


def fake_token(prompt: list[int], num_output: int) -> int:
    """The token a fake request samples next: a lowercase letter, never EOS."""
    return OFFSET + ord("a") + (sum(prompt) + 7 * num_output) % 26


class FakeRunner:
    """Samples `fake_token` for every scheduled entry that ends its known tokens."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {s.request.request_id: fake_token(s.request.prompt_token_ids, s.request.num_output_tokens)
                   for s in sched.scheduled if s.sample}  # fmt: skip
        return ModelRunnerOutput(sampled, {})


class FakeEngine(StepLoop):
    """StepLoop over FakeRunner and FakeTokenizer, checked to be called from one thread only."""

    def __init__(self, max_model_len: int = 512, max_num_seqs: int = 8, block_size: int = 4,
                 num_blocks: int = 1024, step_delay_s: float = 0.0, aging_s: float = 0.0,
                 kv_event_sink: KVEventSink | None = None,
                 tenant_weights: tuple[tuple[str, float], ...] = ()) -> None:  # fmt: skip
        super().__init__(
            model_name="fake-model",
            tokenizer=FakeTokenizer(),
            runner=FakeRunner(),
            block_manager=BlockManager(num_blocks, block_size, record_events=kv_event_sink is not None),
            kv_event_sink=kv_event_sink,
            scheduler_config=SchedulerConfig(max_num_seqs, 2048, aging_s, tenant_weights=tenant_weights),
            max_model_len=max_model_len,
            vocab_size=VOCAB,
            eos_token_ids=frozenset({EOS_ID}),
        )
        self.step_delay_s = step_delay_s
        self.step_gate = threading.Event()  # cleared: step() waits (tests hold the engine mid-step)
        self.step_gate.set()
        self._owner: int | None = None  # the one thread allowed to call step/add/abort

    def add_request(self, *args, **kwargs) -> int:
        self._check_thread()
        return super().add_request(*args, **kwargs)

    def abort(self, request_id: str) -> bool:
        self._check_thread()
        return super().abort(request_id)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        self.step_gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return super().step()

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


if TYPE_CHECKING:  # mypy (tests/test_types.py): the fake satisfies the server's contract

    def _fake_is_an_engine(engine: FakeEngine) -> EngineProtocol:
        return engine
