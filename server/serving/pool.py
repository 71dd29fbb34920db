"""Many models in one server, loaded on demand (`models_dir`): which models are loaded, when one loads and
which one unloads to make room. llama.cpp's router mode in one process: `models_max` (llama.cpp's
`--models-max`), least-recently-used unloading, an idle unload (`models_idle_unload_s`, llama.cpp's
`--sleep-idle-seconds`).

Every name of the folder has a slot in the registry from the start (server/serving/registry.py), loaded or
not; the slot owns its versions, when it was last used and how many requests wait for it. This module owns
only the load and unload tasks and the policy:

- A request for a name whose version is not loaded waits for its load (`ensure`); concurrent first
  requests share one load task. Requests to loaded models never wait on it: loading runs in a thread
  (server/serving/rollout.py load_now: engine build, warm-up, probe).
- Loads run one at a time, so each room check sees the memory the previous load took.
- With `models_max` loaded, the least recently used idle model (nothing in flight, nobody waiting for it)
  unloads first. A loaded model with requests in flight is never unloaded: the load waits for one to go
  idle, up to `models_load_wait_s`, then the waiting requests get 503 with Retry-After.
- Memory is checked before each load (server/ops/memory_check.py): when the model would not fit, idle
  models unload (least recently used first) until it does; when it still does not, 503 naming what is
  needed and free. Never an out-of-memory kill.
- A load that fails (a corrupt model folder) fails that model's waiting requests with 503 naming the
  reason, remembered for `FAILED_RETRY_S` (requests meanwhile get the same answer without a new load);
  the other models keep serving.
- `models_idle_unload_s`: a loaded model without requests that long unloads (checked every
  `_SWEEP_S` at most: a busy model counts as used at each check).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from server.config.settings import ServerSettings
from server.http.errors import ApiError
from server.ops.memory_check import DEFAULT_KV_BYTES
from server.serving.deployment import Probe
from server.serving.registry import ModelRegistry, ModelSlot
from server.serving.rollout import LoadFailed, Rollout

log = logging.getLogger("tokenmill.server")

FAILED_RETRY_S = 30.0  # a failed load is answered from memory this long before a request tries again
_POLL_S = 0.05  # how often a load waiting for room looks again
_SWEEP_S = 1.0  # the idle check's period at most


class ModelPool:
    """The on-demand loading policy over the registry's slots that have a `spec`. On the event loop."""

    def __init__(self, models: ModelRegistry, rollout: Rollout, settings: ServerSettings) -> None:
        self._models = models
        self._rollout = rollout
        self._settings = settings
        self._max = settings.models_max  # 0: no limit
        self._idle_s = settings.models_idle_unload_s
        self._lock = asyncio.Lock()  # one on-demand load at a time
        self._tasks: dict[str, asyncio.Task[None]] = {}  # name -> its load or unload in progress
        self._failed_at: dict[str, float] = {}  # name -> monotonic time of its last failed load
        self._sweeper: asyncio.Task[None] | None = None
        self.unloads: dict[str, int] = {}  # reason (lru, memory, idle) -> count, for logs and tests

    def start(self) -> None:
        if self._idle_s is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._sweeper] if self._sweeper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def busy(self) -> list[str]:
        """The names with a load or unload in progress."""
        return list(self._tasks)

    # -- requests ------------------------------------------------------------------------------------
    async def ensure(self, slot: ModelSlot, pinned: str | None) -> None:
        """Return once `slot` serves `pinned` (None: its promoted version), loading it when needed. The
        caller counts itself in `slot.waiters` meanwhile (so the model is not unloaded under it) and picks
        a version in the same step this returns. Raises ApiError 503 (load failed, no room, no memory)."""
        while not slot.serves(pinned):
            task = self._tasks.get(slot.name)
            if task is None:
                wanted = pinned or slot.promoted
                if wanted != slot.promoted or wanted in slot.versions or wanted in slot.loading:
                    # another version (404), or loaded and not taking requests (still warming up, a dead
                    # worker, an admin load in progress: 503): pick() says which
                    return
                self._check_recent_failure(slot)
                task = self._start(slot, "load", self._load(slot))
            await asyncio.shield(task)  # the load goes on when this request is cancelled (client gone)

    def _check_recent_failure(self, slot: ModelSlot) -> None:
        failed_at = self._failed_at.get(slot.name)
        if failed_at is None or time.monotonic() - failed_at >= FAILED_RETRY_S:
            return
        retry = max(1, int(FAILED_RETRY_S - (time.monotonic() - failed_at)))
        why = slot.failed.get(slot.promoted, "unknown")
        raise ApiError(503, "model_load_failed", f"model {slot.name!r} failed to load ({why}); the next try is in "
                       f"{retry}s", param="model", headers={"Retry-After": str(retry)})  # fmt: skip

    def _start(self, slot: ModelSlot, kind: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work, name=f"{kind}:{slot.name}")
        self._tasks[slot.name] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._tasks.get(slot.name) is t:
                del self._tasks[slot.name]
            if not t.cancelled():
                t.exception()  # retrieved: every waiter got it already

        task.add_done_callback(done)
        return task

    # -- loading -------------------------------------------------------------------------------------
    async def _load(self, slot: ModelSlot) -> None:
        assert slot.spec is not None
        async with self._lock:
            await self._make_room(slot)
            probe = Probe(self._settings.probe_prompt, self._settings.probe_max_tokens)
            try:
                await self._rollout.load_now(slot, probe)
            except LoadFailed as exc:
                self._failed_at[slot.name] = time.monotonic()
                raise ApiError(503, "model_load_failed", f"model {slot.name!r} failed to load ({exc.kind}: "
                               f"{exc.message})", param="model",
                               headers={"Retry-After": str(int(FAILED_RETRY_S))}) from None  # fmt: skip
            self._failed_at.pop(slot.name, None)
            slot.last_used = time.monotonic()

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload idle models until one more fits under models_max and in memory. Raises ApiError 503."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.models_load_wait_s
        while self._max and self._loaded(slot) >= self._max:
            victim = self._least_recently_used(slot)
            if victim is not None:
                await self._unload(victim, "lru")
                continue
            if loop.time() >= deadline:
                raise ApiError(503, "overloaded", f"model {slot.name!r} is not loaded and the {self._max} loaded "
                               f"models (models_max) have requests in flight; retry", param="model",
                               headers={"Retry-After": "1"})  # fmt: skip
            await asyncio.sleep(_POLL_S)
        spec = slot.spec
        assert spec is not None
        kv = self._settings.kv_cache_memory or DEFAULT_KV_BYTES
        while (refusal := self._rollout.memory_refusal(spec, kv, 503)) is not None:
            victim = self._least_recently_used(slot)
            if victim is None:
                refusal.param = "model"
                raise refusal
            await self._unload(victim, "memory")

    def _loaded(self, slot: ModelSlot) -> int:
        """Names other than `slot` holding an engine (loading, loaded or draining)."""
        return sum(1 for other in self._models.slots.values() if other is not slot and (other.versions or other.loading))

    def _least_recently_used(self, slot: ModelSlot) -> ModelSlot | None:
        """The idle model other than `slot` used longest ago, that may load again; None when none is idle."""
        idle = [other for other in self._models.slots.values()
                if other is not slot and other.spec is not None and other.idle() and other.name not in self._tasks]  # fmt: skip
        return min(idle, key=lambda other: other.last_used, default=None)

    # -- unloading -----------------------------------------------------------------------------------
    async def _unload(self, slot: ModelSlot, reason: str) -> None:
        await self._start(slot, "unload", self._unload_now(slot, reason))

    async def _unload_now(self, slot: ModelSlot, reason: str) -> None:
        if not slot.idle():  # a request took it between the choice and this task's first step: keep it
            return
        log.info("unloading %s (%s)", slot.name, reason)
        await self._rollout.unload_now(slot)
        self.unloads[reason] = self.unloads.get(reason, 0) + 1

    async def _sweep(self) -> None:
        assert self._idle_s is not None
        period = min(_SWEEP_S, self._idle_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for slot in list(self._models.slots.values()):
                if slot.spec is None or not slot.versions or slot.name in self._tasks:
                    continue
                if not slot.idle():
                    slot.last_used = now  # busy now: idle time counts from its last request's end
                elif now - slot.last_used >= self._idle_s:
                    self._start(slot, "unload", self._unload_now(slot, "idle"))
