"""One loaded model version: its engine, the worker thread that owns it, its own admission counters and
tokenizer copy, and where it is in its life:

    loading (warm-up, probe) -> ready -> draining (in-flight requests finish) -> unloaded
                             -> failed (never served; unloaded at once)

Routes hold a `Lease` on the version they picked from the moment they pick it until their response is
done, so a version that starts draining between a route's pick and its admission still takes that
request: a swap fails nothing. Runs on the event loop, except the worker's callbacks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api import EngineProtocol, LoraInfo, SamplingParams, TokenLogprob
from server.config.lanes import Lane
from server.config.settings import ServerSettings
from server.config.versions import ModelSpec
from server.http.errors import ApiError
from server.ops.memory import memory_probe
from server.ops.metrics import ModelInfo, Snapshot, VersionMetrics, VersionSnapshot
from server.prompt.codec import PromptCodec
from server.prompt.structured import GrammarObserver, GrammarService
from server.prompt.tools import probe_template
from server.serving.admission import Admission
from server.serving.capacity import engine_seats, usable_context
from server.serving.ticket import Collector, Finished, ServerError, Ticket, Tokens
from server.serving.worker import Worker

log = logging.getLogger("tokenmill.server")

_STOP_JOIN_S = 10.0
_FLUSH_AFTER_ABORT_S = 5.0


class VersionState(str, enum.Enum):
    LOADING = "loading"  # the engine is built (or being built); warm-up and probe not passed yet
    READY = "ready"  # takes requests
    DRAINING = "draining"  # takes no new requests; in-flight ones finish, then it unloads
    FAILED = "failed"  # load, warm-up or probe failed: never served
    UNLOADED = "unloaded"  # worker stopped, engine released


@dataclass(frozen=True)
class Probe:
    """The generation a new version must pass before it can take traffic (greedy, EOS ignored)."""

    prompt: str
    max_tokens: int
    expect: str | None = None  # the output text must contain this; None: any finite output passes


@dataclass
class InternalResult:
    """What an internal (warm-up, probe) generation produced."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None


class ProbeFailed(RuntimeError):
    """The version generated, but not what a healthy model does (error, non-finite scores, no match)."""


class Deployment:
    """One loaded version. `leases` counts routes that picked it and have not finished their response."""

    def __init__(
        self,
        spec: ModelSpec,
        engine: EngineProtocol,
        settings: ServerSettings,
        metrics: VersionMetrics,
        on_finish: Callable[[Deployment, Ticket], None],
    ) -> None:
        self.spec = spec
        self.engine_name = engine.model_name  # the folder's name: accepted as an alias of the model
        self.max_model_len: int = usable_context(engine)  # the KV cache's size when that is smaller
        self.max_num_seqs: int = engine_seats(engine, settings.max_num_seqs)  # seats: a request's share of them
        self.engine_desc = {"dtype": engine.dtype_name, "device": engine.device_name}
        # LoRA adapters its engine holds, by name: read before the worker owns the engine, then kept in
        # step by the load/unload endpoints (server/api/lora.py), which change the engine on its thread
        self.adapters: dict[str, LoraInfo] = {info.name: info for info in engine.list_loras()}
        self.lora_enabled = settings.lora_config() is not None
        self.kv_cache_bytes: int | None = getattr(engine, "kv_cache_bytes", None)  # the real engine's KV budget
        # copied before the worker owns the engine; the server's --chat-template replaces the model's
        self.codec = PromptCodec(engine.tokenizer, settings.chat_template_text())
        self.tool_template = probe_template(engine.tokenizer, settings.chat_template_text())  # what it renders of tools
        self.tool_parser = settings.tool_call_parser
        self.reasoning_parser = settings.reasoning_parser  # server/prompt/reasoning.py; None: no reasoning parsing
        # Compiles through this engine's grammar compiler (thread-safe), off the loop and the worker.
        self.grammars = GrammarService(engine.grammar_compiler, settings.structured_compile_timeout_s,
                                       settings.structured_max_grammar_bytes,
                                       GrammarObserver(metrics.observe_grammar_compile, metrics.observe_grammar_rejected))
        self.admission = Admission(settings.lane_bounds())
        self.metrics = metrics
        self.memory = memory_probe(engine)
        owner = weakref.ref(self)  # no cycle through the worker: the engine goes as soon as the version does

        def finished(ticket: Ticket) -> None:
            dep = owner()
            if dep is not None:
                on_finish(dep, ticket)
                if _grammar_dead_end(ticket):
                    metrics.observe_grammar_rejected("no_next_token")

        self.worker = Worker(
            engine,
            self.admission,
            on_finish=finished,
            on_step=metrics.observe_step,
            on_token_gap=metrics.observe_token_gap,
            keep_outputs=settings.log_prompts,
        )
        self.state = VersionState.LOADING
        self.error: str | None = None  # why it failed
        self.leases = 0
        self.loaded_at = time.time()
        self.ready_at: float | None = None
        self.timings: dict[str, float] = {}  # load_s, warmup_s, probe_s (admin loads)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> str:
        return self.spec.version

    @property
    def accepting(self) -> bool:
        """New requests may be routed here."""
        return self.state is VersionState.READY and self.worker.alive

    def busy(self) -> int:
        """Routes holding it plus requests in its engine: 0 means drained."""
        return self.leases + self.worker.in_flight()

    def acquire(self, lora: str | None = None) -> Lease:
        """A lease on this version, on adapter `lora` when given. Raises ApiError 404 when the version
        does not hold that adapter (it was unloaded, or a canary lacks it)."""
        if lora is None:
            return Lease(self)
        info = self.adapters.get(lora)
        if info is None:
            raise ApiError(404, "model_not_found", f"adapter {lora!r} is not loaded on {self.spec.ref}", param="model")
        return Lease(self, info)

    # -- life ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    async def warm_up(self, timeout_s: float) -> None:
        """One short greedy generation through the whole path. Raises when it fails."""
        ids = await self.codec.encode("Hello") or [0]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        result = await self.generate_internal(ids, params, timeout_s)
        self.timings["warmup_s"] = round(time.perf_counter() - started, 4)
        finished = result.finished
        if finished is None or finished.error is not None or finished.reason == "error":
            raise RuntimeError(finished.error.message if finished and finished.error else "engine error")

    async def probe(self, probe: Probe, timeout_s: float) -> InternalResult:
        """A real generation, checked: it must finish normally with finite log-probabilities (NaN weights
        fail here) and contain `probe.expect` when given. Raises ProbeFailed."""
        ids = await self.codec.encode(probe.prompt)
        params = SamplingParams(max_tokens=probe.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        started = time.perf_counter()
        result = await self.generate_internal(ids, params, timeout_s)
        self.timings["probe_s"] = round(time.perf_counter() - started, 4)
        finished = result.finished
        if finished is None or finished.error is not None or finished.reason not in ("stop", "length"):
            why = finished.error.message if finished and finished.error else (finished.reason if finished else "none")
            raise ProbeFailed(f"the probe generation did not finish normally: {why}")
        if not result.token_ids:
            raise ProbeFailed("the probe generated no tokens")
        bad = [lp.logprob for lp in result.logprobs if not math.isfinite(lp.logprob)]
        if bad or len(result.logprobs) != len(result.token_ids):
            raise ProbeFailed(f"the probe's log-probabilities are not finite ({len(bad)} of {len(result.logprobs)})")
        if probe.expect is not None and probe.expect not in result.text:
            raise ProbeFailed(f"the probe output {result.text!r} does not contain {probe.expect!r}")
        return result

    async def generate_internal(self, ids: list[int], params: SamplingParams, timeout_s: float) -> InternalResult:
        """Run one request that metrics and logs do not count; aborted when it takes over `timeout_s`."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(f"internal-{uuid.uuid4().hex}", ids, params, Lane.INTERACTIVE, Collector(loop), internal=True)
        if self.worker.submit(ticket) is not None:
            raise RuntimeError("the internal request was refused")
        result = InternalResult()
        deadline = loop.time() + timeout_s
        try:
            while result.finished is None:
                if loop.time() >= deadline:
                    raise TimeoutError(f"no answer within {timeout_s:g}s")
                event = await ticket.collector.next(min(1.0, deadline - loop.time()))
                if event is None:
                    if not self.worker.thread_running:
                        raise RuntimeError("the engine worker is not running")
                    continue
                if isinstance(event, Tokens):
                    result.token_ids.extend(event.output.new_token_ids)
                    result.text += event.output.text_delta
                    result.logprobs.extend(event.output.logprobs or [])
                elif isinstance(event, Finished):
                    result.finished = event
        finally:
            if result.finished is None:
                self.worker.abort(ticket.request_id)
        return result

    async def drain(self, timeout_s: float) -> None:
        """Wait until every route and request holding it is done; after `timeout_s`, end what is left with
        an error and wait a few seconds more for those responses to be sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.busy() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.worker.in_flight():
            log.warning("%s: drain timeout, aborting %d requests", self.spec.ref, self.worker.in_flight())
            message = f"model version {self.spec.ref} was unloaded (drain timeout {timeout_s:g}s)"
            self.worker.abort_all(ServerError("shutdown", message, 503))
        end = loop.time() + _FLUSH_AFTER_ABORT_S
        while self.leases and loop.time() < end:
            await asyncio.sleep(0.02)

    async def unload(self) -> None:
        """Stop the worker (it aborts anything left) and let the engine go."""
        self.state = VersionState.UNLOADED if self.state is not VersionState.FAILED else self.state
        await asyncio.to_thread(self.worker.stop, _STOP_JOIN_S)
        self.codec.close()
        self.grammars.close()
        self.memory = _no_memory  # its closure holds the engine

    # -- reports -------------------------------------------------------------------------------------
    def snapshot(self, role: str, weight: int) -> VersionSnapshot:
        info = ModelInfo(self.name, self.engine_desc["dtype"], self.engine_desc["device"], self.version,
                         self.max_model_len)  # fmt: skip
        snap = Snapshot(stats=self.worker.stats, lanes=self.worker.lane_load(), worker_alive=self.worker.alive,
                        waiting_adapters=self.worker.waiting_adapters(),
                        memory=self.memory(), grammar_cache=self.grammars.cache_size())  # fmt: skip
        return VersionSnapshot(info, self.state.value, role, weight, snap, self.metrics.seconds_since_last_step())


def _grammar_dead_end(ticket: Ticket) -> bool:
    """The request ended because its grammar allowed no next token (the engine named the grammar's field)."""
    spec, error = ticket.params.structured, ticket.error
    return spec is not None and error is not None and error.kind == "invalid_request" and error.param == spec.param


def _no_memory() -> None:
    return None


class Lease:
    """A route's hold on the version it picked, from the pick until its response is done. Release it
    exactly once (further calls do nothing)."""

    def __init__(self, deployment: Deployment, lora: LoraInfo | None = None) -> None:
        self.deployment = deployment
        self.lora = lora  # the adapter the request named (its `model`); None: the base model
        self._held = True
        deployment.leases += 1

    def sibling(self) -> Lease:
        """Another lease on the same version and adapter (a request's other choices)."""
        return Lease(self.deployment, self.lora)

    def served_name(self, model: str) -> str:
        """The name a response reports: the adapter's when the request ran on one (vLLM's), else `model`."""
        return model if self.lora is None else self.lora.name

    def release(self) -> None:
        if self._held:
            self._held = False
            self.deployment.leases -= 1
