"""The step loop: requests in, one step as schedule, run, update, outputs and stats out, in plain
Python (no torch).

`StepLoop` owns the requests, the scheduler, the block manager and the output processing. What runs
the model is a `StepRunner` (anything with `execute(SchedulerOutput) -> ModelRunnerOutput`,
engine/sched/outputs.py): `engine.engine.Engine` plugs in the real one (torch,
engine/runner/model_runner.py), the server's tests a fake that makes up tokens, so both run this code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api import Deadlines, EngineStats, FinishReason, InvalidParam, RequestOutput, TokenLogprob
from engine.api.errors import LoraError
from engine.api.outputs import LoraInfo
from engine.api.sampling_params import SamplingParams
from engine.core.output_processor import (
    RequestTextState,
    add_prompt_logprobs,
    error_output,
    merge_outputs,
    prompt_only_output,
    started_output,
    timeout_output,
    token_output,
)
from engine.core.thread_governor import ThreadGovernor
from engine.kv.block_manager import BlockManager
from engine.kv.events import AllBlocksCleared, BlockRemoved, KVEventSink
from engine.lora.registry import LoraRegistry
from engine.request import Request, RequestStatus
from engine.sched.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, StepRunner
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.state.checkpoints import CheckpointIndex
from engine.state.pool import StatePool
from engine.structured import GrammarCompiler, GrammarError
from engine.text.tokenization import chat_prompt_ids, encode_prompt

log = logging.getLogger("tokenmill.engine")

NONFINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request; no token was sampled"
GRAMMAR_DEAD_END = ("the structured output's grammar allows no next token here (a pattern that needs characters "
                    "the JSON rules or this model's vocabulary cannot give); no token was sampled")


@dataclass
class GenerationResult:
    """One finished request of Engine.generate()."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when params.prompt_logprobs was set


class StepLoop:
    """Single-threaded and synchronous; see engine/api/ EngineProtocol for the contract."""

    def __init__(
        self,
        *,
        model_name: str,
        tokenizer: Any,
        runner: StepRunner,
        block_manager: BlockManager,
        scheduler_config: SchedulerConfig,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        clock: Callable[[], float] = time.monotonic,
        grammar_compiler: GrammarCompiler | None = None,
        kv_event_sink: KVEventSink | None = None,
        loras: LoraRegistry | None = None,
        state_pool: StatePool | None = None,
        checkpoints: CheckpointIndex | None = None,
    ) -> None:
        """`kv_event_sink`: where each step's prefix-cache changes go (the block manager must record
        them: BlockManager(record_events=True)); None: no events. `state_pool`: a hybrid model's
        recurrent-state slots (engine/state/pool.py), admitted against by the scheduler; None: none.
        `checkpoints`: its state checkpoints (engine/state/checkpoints.py); None: it reuses no prefix."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        # Compiles GrammarSpecs for this tokenizer; the server uses it off this thread. None: no backend.
        self.grammar_compiler = grammar_compiler
        self.runner = runner
        self.loras = loras  # LoRA adapters by name; None: LoRA off (requests naming one are refused)
        if loras is not None and scheduler_config.max_loras is None:
            scheduler_config = replace(scheduler_config, max_loras=loras.config.max_loras)
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.state_pool = state_pool
        self.checkpoints = checkpoints
        self.scheduler = Scheduler(scheduler_config, block_manager, clock, state_pool, checkpoints)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._stats = EngineStats(kv_blocks_total=block_manager.num_blocks, block_size=block_manager.block_size)
        # CPU: picks the steps' thread count from their measured times (engine/core/thread_governor.py); the
        # real engine sets it, None: the count set at start-up stays
        self.thread_governor: ThreadGovernor | None = None
        # CPU: sets the stepping thread's count to this engine's before each step (engine/core/thread_count.py
        # ThreadPin; the real engine sets it); None: nothing checked
        self.thread_pin: Callable[[], None] | None = None
        self._kv_sink = kv_event_sink
        # a batch was dropped: the next publish re-announces the whole cache (snapshot_events)
        self._kv_resync = False
        if kv_event_sink is not None:  # a new, empty cache: consumers forget what this worker said before
            self._kv_resync = not kv_event_sink.publish([AllBlocksCleared()])

    # ---- names the server reads (the real engine overrides the device ones) --------------------------
    dtype_name = "float32"
    device_name = "cpu"

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def device_memory(self) -> dict[str, int] | None:
        return None

    def expert_counts(self) -> list[list[int]] | None:
        return None  # a dense model (the real engine reads a mixture-of-experts model's)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        deadlines: Deadlines | None = None,
        tenant: str = "",
    ) -> int:
        """Queue a request. Returns its prompt length in tokens. Raises InvalidParam naming the field.
        `tenant` names who it is billed to: the fair share between tenants (engine/sched/fair_share.py)."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidParam("request_id", "request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise InvalidParam("request_id", f"request_id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidParam("priority", f"priority must be an integer, got {priority!r}")
        if not isinstance(tenant, str):
            raise InvalidParam("tenant", f"tenant must be a string, got {type(tenant).__name__}")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        self._check_fits(len(ids), params.max_tokens)
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidParam("logit_bias", f"logit_bias: {bad[0]} is not a token id in [0, {self.vocab_size})")
        params = self._with_grammar(params)
        lora_id = self._lora_id(params.lora_name)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_time=self.scheduler.clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            deadlines=deadlines or Deadlines(),
            lora_id=lora_id,
            tenant=tenant,
        )
        req.text = RequestTextState(self.tokenizer, params.stop)
        self.scheduler.add(req)
        return len(ids)

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """See EngineProtocol.set_tenant_weights."""
        self.scheduler.fair.set_weights(weights)

    def _lora_id(self, name: str | None) -> int:
        if name is None:
            return 0
        if self.loras is None:
            raise InvalidParam("model", f"model {name!r}: LoRA adapters are not enabled on this engine")
        return self.loras.resolve(name)

    # ---- LoRA adapters (engine/lora/) ---------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoraInfo:
        """Register the PEFT adapter at `path` as `name`; see EngineProtocol.load_lora."""
        if name == self.model_name:
            raise LoraError("lora_name", f"{name!r} is the base model's name")
        return self._lora_registry().add(name, path)

    def unload_lora(self, name: str) -> LoraInfo:
        """Forget adapter `name`; requests in flight on it finish (see EngineProtocol.unload_lora)."""
        info = self._lora_registry().remove(name)
        self._collect_loras()
        return info

    def list_loras(self) -> list[LoraInfo]:
        return [] if self.loras is None else self.loras.infos()

    def _lora_registry(self) -> LoraRegistry:
        if self.loras is None:
            raise LoraError("lora_name", "LoRA adapters are not enabled on this engine (--enable-lora)")
        return self.loras

    def _collect_loras(self) -> None:
        if self.loras is not None:
            self.loras.collect(r.lora_id for r in self.scheduler.requests.values())

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidParam("prompt", "give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidParam("prompt", "prompt must be a string")
            ids = self.encode(prompt)
            if not ids:
                raise InvalidParam("prompt", "prompt must not be empty")
            return ids
        ids = list(prompt_token_ids or [])
        if not ids:
            raise InvalidParam("prompt_token_ids", "prompt_token_ids must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidParam("prompt_token_ids", f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})")
        return ids

    def _with_grammar(self, params: SamplingParams) -> SamplingParams:
        """params with its grammar compiled by this engine's compiler: the server sends it compiled; a
        direct caller (offline use, tests) may not, and a grammar of another compiler is recompiled."""
        spec = params.structured
        if spec is None or (spec.compiled is not None and spec.compiled.owner is self.grammar_compiler):
            return params
        if self.grammar_compiler is None:
            raise InvalidParam("structured", "structured outputs are off: this engine has no grammar backend")
        try:
            compiled = self.grammar_compiler.compile(spec)
        except GrammarError as exc:
            raise InvalidParam("structured", f"the {spec.kind} grammar does not compile: {exc}") from None
        return replace(params, structured=spec.with_compiled(compiled))

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        field_name = "prompt" if num_prompt >= self.max_model_len else "max_tokens"
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidParam(field_name, f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                               f"context length max_model_len ({self.max_model_len})")  # fmt: skip
        bs, capacity = self.block_size, self.block_manager.num_blocks
        if -(-(num_prompt + max_tokens) // bs) > capacity:
            raise InvalidParam(field_name, f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                               f"KV cache ({capacity * bs} tokens)")  # fmt: skip

    def abort(self, request_id: str) -> bool:
        """End a request now and free its KV blocks. False when it is unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        self._collect_loras()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, update; then publish the step's KV-cache events. Returns this step's outputs:
        one per request that started, sampled, timed out or failed in it."""
        outputs = self._step()
        self._publish_kv_events()
        return outputs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs = [timeout_output(req, kind) for req, kind in sched.expired]
        if sched.is_empty:
            return outputs
        if self.thread_pin is not None:
            self.thread_pin()
        try:
            result = self.runner.execute(sched)
        except Exception as exc:  # a failed step fails only its own requests
            return outputs + self._fail_step(sched, exc)
        emitted = self._stats.generation_tokens
        outputs += self._update(sched, result)
        self._collect_loras()
        elapsed = time.perf_counter() - t0
        self._record_step(sched, elapsed)
        self.scheduler.record_step_time(sched, elapsed, self._stats.generation_tokens - emitted)
        return outputs

    # ---- KV-cache events -----------------------------------------------------------------------
    def _publish_kv_events(self) -> None:
        """Hand the block manager's events to the sink (one batch per step; never waits). After a
        dropped batch the consumers' view is unknown, so the next batch is the whole cache instead."""
        if self._kv_sink is None:
            return
        events = self.block_manager.take_events()
        if self._kv_resync:
            if not self._kv_sink.has_room():  # still full: this step's events are lost too (and counted)
                if events:
                    self._kv_sink.publish(events)
                return
            events = self.block_manager.snapshot_events()
        if events:
            self._kv_resync = not self._kv_sink.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (AllBlocksCleared is published). False while requests hold blocks."""
        done = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def retire_kv_events(self) -> None:
        """The engine is going away (its version unloads): publish the removal of every block it still
        caches, so consumers keep no stale hashes; nothing more is published afterwards."""
        if self._kv_sink is None:
            return
        self._publish_kv_events()
        hashes = sorted(self.block_manager.cached_hashes())
        if hashes:
            self._kv_sink.publish([BlockRemoved(hashes)])
        self._kv_sink = None

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        self.scheduler.advance(sched)
        started = {id(r) for r in sched.started}
        failed = set(result.failed)
        outputs = []
        for s in sched.scheduled:
            req = s.request
            add_prompt_logprobs(req, result.prompt_logprobs.get(req.request_id))
            length = req.num_tokens
            if req.request_id in result.spec_tokens:
                outputs.append(self._verified_output(s, result.spec_tokens[req.request_id],
                                                     result.spec_logprobs.get(req.request_id), id(req) in started))
                self._past_rope_switch(req, length)
                continue
            token = result.sampled.get(req.request_id)
            dead_end = _grammar_dead_end(req) if token is None and req.request_id in failed else None
            if dead_end is not None:  # the request's fault, not the engine's
                outputs.append(error_output(req, GRAMMAR_DEAD_END, started=id(req) in started, param=dead_end))
                self.scheduler.finish(req, FinishReason.ERROR)
                continue
            if token is None and req.request_id in failed:  # NaN/inf logits: fail this request, not the step
                outputs.append(error_output(req, NONFINITE_LOGITS, started=id(req) in started))
                self.scheduler.finish(req, FinishReason.ERROR)
                continue
            if token is None and s.start + s.num_tokens == req.num_tokens and req.params.max_tokens == 0:
                outputs.append(prompt_only_output(req, started=id(req) in started))  # nothing to sample
                self.scheduler.finish(req, FinishReason.LENGTH)
                continue
            if token is None:  # a prompt chunk that did not reach the end of the prompt
                if id(req) in started:
                    outputs.append(started_output(req))
                continue
            out = token_output(req, token, result.logprobs.get(req.request_id), self.max_model_len,
                               started=id(req) in started)  # fmt: skip
            if out.finished:
                self.scheduler.finish(req, out.finish_reason or FinishReason.STOP)
            outputs.append(out)
            self._past_rope_switch(req, length)
        return outputs

    def _past_rope_switch(self, req: Request, length: int) -> None:
        """LongRoPE: a running request that just grew past the switch (from `length` tokens) computed its
        K/V with the short factors; transformers' Phi-3 then drops its cache and turns the whole sequence
        with the long ones. Its blocks are freed (those in the prefix cache stay findable: their K/V
        are right for requests below the switch) and it stays running: the next steps compute it again
        from its first token, under the long factors (engine/models/rope.py, engine/kv/block_manager.py)."""
        switch = self.block_manager.rope_switch
        if switch is None or not length <= switch < req.num_tokens or req.status != RequestStatus.RUNNING:
            return
        self.block_manager.free(req)
        self._stats.rope_recomputes += 1

    def _verified_output(self, s: ScheduledRequest, tokens: list[int], logprobs: list[TokenLogprob] | None,
                         started: bool) -> RequestOutput:  # fmt: skip
        """Append a verified row's tokens (up to a finish), roll its rejected drafts' KV back, count."""
        req, outs = s.request, []
        for i, t in enumerate(tokens):
            if req.grammar is not None:  # verified under its masks (engine/sample/draft_positions.py): it takes t
                req.grammar.accept(t)
            outs.append(token_output(req, t, logprobs[i] if logprobs else None, self.max_model_len, started=started))
            if outs[-1].finished:
                break
        accepted = len(tokens) - 1
        self._stats.record_drafts(len(s.draft_token_ids), accepted)
        self._stats.generation_tokens += len(outs) - 1  # the step's count has one per sampled row
        out = merge_outputs(outs)
        if out.finished:
            self.scheduler.finish(req, out.finish_reason or FinishReason.STOP)
        else:
            self.scheduler.settle_drafts(s, accepted)
        return out

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        log.exception("engine step failed; failing its %d requests", len(sched.scheduled))
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        started = {id(r) for r in sched.started}
        outputs = []
        for s in sched.scheduled:
            outputs.append(error_output(s.request, message, started=id(s.request) in started))
            self.scheduler.finish(s.request, FinishReason.ERROR)
        return outputs

    def _record_step(self, sched: SchedulerOutput, elapsed: float) -> None:
        st = self._stats
        decode = sum(s.num_tokens for s in sched.scheduled
                     if s.draft_token_ids or (s.num_tokens == 1 and s.start >= s.request.num_prompt_tokens))  # fmt: skip
        st.steps += 1
        st.last_step_tokens = sched.num_tokens
        st.last_step_decode_tokens = decode
        st.last_step_prefill_tokens = sched.num_tokens - decode
        st.prompt_tokens += sched.num_tokens - decode
        st.generation_tokens += sum(1 for s in sched.scheduled if s.sample)
        st.last_step_time_s = elapsed
        gov = self.thread_governor
        if gov is not None:
            gov.observe(decode, sched.num_tokens - decode, elapsed)
            st.cpu_threads, st.cpu_thread_switches = gov.threads, gov.switches

    def stats(self) -> EngineStats:
        """A fresh snapshot (the caller may keep it; nothing in it changes afterwards)."""
        st = self._stats
        sched = self.scheduler
        return EngineStats(**{
            **vars(st),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "waiting_preempted": sched.waiting.num_resumed,
            "kv_blocks_used": self.block_manager.num_used_blocks,
            "prefix_cache_queries": self.block_manager.prefix_queries,
            "prefix_cache_hits": self.block_manager.prefix_hits,
            "preemptions": sched.num_preemptions,
            "preemptions_by": dict(sched.preemptions_by),
            "spec_accepted_per_pos": list(st.spec_accepted_per_pos),
            **self._lora_stats(),
        })  # fmt: skip

    def _lora_stats(self) -> dict[str, Any]:
        if self.loras is None:
            return {}
        names = {i.lora_id: i.name for i in self.loras.infos()}
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for req in self.scheduler.requests.values():
            name = names.get(req.lora_id)  # None: the base model, or an unloaded adapter finishing
            if name is not None:
                side = running if req.status is RequestStatus.RUNNING else waiting
                side[name] = side.get(name, 0) + 1
        st = self.loras.stats
        return {"lora_running": running, "lora_waiting": waiting, "max_loras": self.loras.config.max_loras,
                "lora_loads": st.loads, "lora_load_s": st.load_s}

    def check_integrity(self) -> None:
        """Block-manager (and state-pool, checkpoint) invariants against the live requests (tests; debug)."""
        self.block_manager.check_integrity(self.scheduler.requests.values())
        if self.state_pool is not None:
            self.state_pool.check_integrity(self.scheduler.requests.values())
        if self.checkpoints is not None:
            self.checkpoints.check_integrity(self.scheduler.requests.values())

    # ---- offline convenience ------------------------------------------------------------------
    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion (all submitted at once); results in prompt order.
        Needs an idle engine: it steps until everything is done and would swallow other outputs."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; use add_request/step alongside other work")
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            rid = f"gen-{id(results)}-{i}"
            kwargs: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
            self.add_request(rid, params=p, **kwargs)
            ids = self.scheduler.requests[rid].prompt_token_ids
            results[rid] = GenerationResult(rid, list(ids), [], "", None)
            order.append(rid)
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r.token_ids.extend(out.new_token_ids)
                r.text += out.text_delta
                r.logprobs.extend(out.logprobs or [])
                r.cached_tokens = out.cached_tokens
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    r.finish_reason = out.finish_reason
        return [results[rid] for rid in order]


def _grammar_dead_end(req: Request) -> str | None:
    """The field that asked for req's grammar when it allowed no token at all in the step just sampled
    (its mask was empty), else None."""
    spec = req.params.structured
    if spec is None or req.grammar is None or not req.grammar.allows_nothing():
        return None
    return spec.param
