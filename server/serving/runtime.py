"""What one app shares, built in the lifespan and kept on `app.state.runtime`, and its lifecycle: the
settings, the loaded model versions (server/serving/registry.py; each version has its own engine,
worker thread, admission counters and tokenizer copy: server/serving/deployment.py), the rollout that
changes them, the response cache, request accounting and feedback, metrics, readiness, warm-up and
drain. Readiness checks live in server/serving/readiness.py, request accounting in
server/serving/accounting.py, loading models on demand (`models_dir`) in server/serving/pool.py: the
runtime owns them and wires them to the deployments.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import math
import time

from engine.api import EngineProtocol
from server.config.lanes import Lane
from server.config.settings import DRAIN_FLUSH_S, ServerSettings
from server.config.versions import ModelSpec
from server.ops.feedback import FeedbackStore, RequestRecords
from server.ops.metrics import CacheStats, ServerMetrics, VersionSnapshot
from server.ops.tenant_metrics import TenantMetrics
from server.prompt.codec import PromptCodec
from server.serving.accounting import RequestAccounting
from server.serving.adapters import AdapterSync
from server.serving.deployment import Deployment, Lease, VersionState
from server.serving.loading import VersionLoader
from server.serving.pool import ModelPool
from server.serving.readiness import Readiness
from server.serving.registry import ModelRegistry, ModelSlot
from server.serving.response_cache import CacheKey, ResponseCache
from server.serving.rollout import Rollout
from server.serving.tenants import Tenants
from server.serving.ticket import ServerError
from server.serving.worker import Worker

log = logging.getLogger("tokenmill.server")


class Runtime:
    """The app's shared state: the registry of loaded model versions (each with its own engine, worker
    and admission counters), the response cache, request accounting and feedback, metrics, readiness
    and drain. Methods run on the event loop unless they say otherwise."""

    def __init__(
        self,
        settings: ServerSettings,
        initial: list[tuple[ModelSpec, EngineProtocol, set[str]]],
        loader: VersionLoader,
        feedback: FeedbackStore | None = None,
        catalog: list[tuple[ModelSpec, set[str]]] | None = None,
    ) -> None:
        """`catalog`: every model a models folder serves by name, loaded on demand (None: only the
        `initial` versions serve); those of `initial` are loaded already, the others load on first use."""
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        longest = max((int(engine.max_model_len) for _, engine, _ in initial), default=131072)
        self.metrics = ServerMetrics(_version(), self._snapshots, cache_stats=self._cache_stats,
                                     max_model_len=longest)  # fmt: skip
        self.cache = ResponseCache(settings.response_cache_bytes, settings.response_cache_ttl_s,
                                   on_evict=self._on_evict)  # fmt: skip
        self.records = RequestRecords(settings.request_records, settings.request_record_ttl_s)
        self.tenants = Tenants(settings.tenants)  # keys -> tenant, and their quotas
        self.tenant_metrics = TenantMetrics(self.metrics.registry, self.tenants.names)
        self.accounting = RequestAccounting(self.records, settings.log_prompts, self.tenant_metrics)
        self.feedback = feedback
        self.models = ModelRegistry()
        for spec, engine, aliases in initial:
            self.models.add_slot(self.new_deployment(spec, engine), aliases, on_demand=catalog is not None)
        for spec, aliases in catalog or []:
            if spec.name not in self.models.slots:
                self.models.add_unloaded(spec, aliases)
        self.readiness = Readiness(self.models, settings.stall_timeout_s)
        self.adapters = AdapterSync()  # LoRA adapters kept the same on every version of a model
        self.rollout = Rollout(self.models, settings, loader, self.new_deployment, self.metrics.version,
                               self._drop_cached, self._match_adapters)  # fmt: skip
        self.pool = ModelPool(self.models, self.rollout, settings) if catalog is not None else None
        self.started_at = time.monotonic()
        self.created = int(time.time())
        self.open_responses = 0  # request handles not closed yet (their responses are still being sent)
        self._tasks: set[asyncio.Task] = set()

    def new_deployment(self, spec: ModelSpec, engine: EngineProtocol) -> Deployment:
        metrics = self.metrics.version(spec.name, spec.version)
        return Deployment(spec, engine, self.settings, metrics, self.accounting.finished)

    # -- the default model's promoted version (what single-model code and /health report) -------------
    @property
    def primary(self) -> Deployment:
        return self.models.primary

    @property
    def worker(self) -> Worker:
        return self.primary.worker

    @property
    def codec(self) -> PromptCodec:
        return self.primary.codec

    @property
    def max_model_len(self) -> int:
        return self.primary.max_model_len

    @property
    def model_name(self) -> str:
        return self.models.default.name

    @property
    def engine_desc(self) -> dict[str, str]:
        return self.primary.engine_desc

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker thread and, in the background, the warm-up."""
        for _, dep in self.models.deployments():
            dep.start()
        task = self.loop.create_task(self.warm_up())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self.pool is not None:
            self.pool.start()

    async def close(self) -> None:
        """Abort what is left and stop the workers (end of the lifespan)."""
        self.readiness.draining = True
        for task in list(self._tasks):
            task.cancel()
        if self.pool is not None:
            await self.pool.close()
        await self.rollout.close()
        await asyncio.gather(*(dep.unload() for _, dep in self.models.deployments()))
        if self.feedback is not None:
            await asyncio.to_thread(self.feedback.close)

    async def warm_up(self) -> None:
        """One short greedy generation per startup version; ready only if every one works."""
        deployments = [dep for _, dep in self.models.deployments()]
        try:
            if self.settings.warmup:
                for dep in deployments:
                    await dep.warm_up(math.inf)
            for dep in deployments:
                dep.state, dep.ready_at = VersionState.READY, time.time()
            self.readiness.ready = True
            log.info("warm-up done: %s ready", ", ".join(dep.spec.ref for dep in deployments))
        except Exception as exc:
            self.readiness.failure = f"warm-up failed: {exc}"
            log.error(self.readiness.failure)

    async def drain(self) -> None:
        """Refuse new requests, let in-flight ones finish within drain_timeout_s; at that deadline end the
        rest at once with an error (event), whatever step the engine is in the middle of, and return
        once their responses were sent or DRAIN_FLUSH_S passed."""
        self.readiness.draining = True
        timeout = self.settings.drain_timeout_s
        log.info("draining: %d requests in flight, up to %.0fs", self._in_flight(), timeout)
        deadline = self.loop.time() + timeout
        while (self.open_responses or self._in_flight()) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._in_flight():
            log.warning("drain timeout: aborting %d requests", self._in_flight())
            error = ServerError("shutdown", f"the server shut down (drain timeout {timeout:g}s)", 503)
            for _, dep in self.models.deployments():
                dep.worker.end_all_now(error)  # the responses' error events go out now ...
                dep.worker.abort_all(error)  # ... the engine drops the requests after its step in flight
        end = self.loop.time() + DRAIN_FLUSH_S
        while self.open_responses and self.loop.time() < end:
            await asyncio.sleep(0.01)
        log.info("drained")

    def _in_flight(self) -> int:
        return sum(dep.worker.in_flight() for _, dep in self.models.deployments())

    # -- requests ------------------------------------------------------------------------------------
    async def acquire(self, model: str | None) -> tuple[ModelSlot, Lease]:
        """Route a new request (server/serving/registry.py acquire): its slot and a lease on the version
        that serves it, after loading the model when it is a models folder's model not loaded yet (the
        request waits; requests to loaded models do not). Raises ApiError 404 (unknown model) or 503."""
        slot, pinned, adapter = await self.loaded(model)
        # no await from here on: the version picked is leased before anything can unload it
        slot.last_used = time.monotonic()
        dep = slot.pick(pinned)
        return slot, dep.acquire() if adapter is None else dep.acquire(adapter)

    async def loaded(self, model: str | None) -> tuple[ModelSlot, str | None, str | None]:
        """registry.route(model) (slot, pinned version, adapter), once the slot serves it: a models
        folder's model not loaded yet loads first. Raises ApiError 404 or 503."""
        slot, pinned, adapter = self.models.route(model)
        if self.pool is not None and slot.spec is not None and not slot.serves(pinned):
            slot.waiters += 1  # not unloaded while this request waits for it
            try:
                await self.pool.ensure(slot, pinned)
            finally:
                slot.waiters -= 1
        return slot, pinned, adapter

    def lane_for_size(self, tokens: int) -> Lane:
        return Lane.INTERACTIVE if tokens <= self.settings.short_request_tokens else Lane.STANDARD

    async def _match_adapters(self, slot: ModelSlot, dep: Deployment) -> None:
        """A new version of `slot` gets the adapters its promoted version serves (raises AdapterMismatch)."""
        await self.adapters.match(slot.versions.get(slot.promoted), dep)

    def _drop_cached(self, model: str, version: str | None) -> None:
        self.cache.drop(model, version)

    # -- scrape-time reports -------------------------------------------------------------------------
    def _snapshots(self) -> list[VersionSnapshot]:
        out = []
        for slot, dep in self.models.deployments():
            if dep.state is VersionState.UNLOADED:
                continue
            weight = slot.weight if slot.canary == dep.version else 0
            out.append(dep.snapshot(slot.role(dep.version), weight))
        return out

    def _cache_stats(self) -> list[CacheStats]:
        return self.cache.stats()

    def _on_evict(self, key: CacheKey) -> None:
        self.metrics.version(key.model, key.version).cache_evictions.inc()


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
