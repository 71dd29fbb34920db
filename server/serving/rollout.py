"""Rollout operations behind the admin API: load a version beside the running one, promote it, send a
canary share to it, roll back, retire a version (drain, then unload). On the event loop; the only
blocking part, building an engine, runs in a thread.

A new version is loaded in the same process with its own engine, worker thread and KV budget, after a
memory check (507 when it cannot fit). It is given the LoRA adapters the promoted version serves
(server/serving/adapters.py; one that does not load fails the load), then runs the warm-up and a real generation probe
(server/serving/deployment.py); only then is it `ready`. A version that fails any of these is unloaded at once
and listed as `failed`: it is never routed to, and nothing about the running version changes (its
readiness included). Promote, rollback and canary changes are in-memory switches of the registry
(server/serving/registry.py): they take effect for the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from engine.api import EngineProtocol
from server.config.versions import ModelSpec, check_version, version_folder
from server.http.errors import ApiError
from server.ops import memory_check
from server.serving.deployment import Deployment, Probe, VersionState
from server.serving.fresh_thread import in_fresh_thread
from server.serving.loading import VersionLoader
from server.serving.registry import ModelRegistry, ModelSlot

if TYPE_CHECKING:
    from server.config.settings import ServerSettings
    from server.ops.metrics import VersionMetrics

log = logging.getLogger("tokenmill.server")

class LoadFailed(Exception):
    """A version did not load or did not pass its warm-up or probe."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # load_failed or probe_failed
        self.message = message


class Rollout:
    """The rollout state machine of every model name; see the module docstring. Built from the parts it
    uses: the registry it switches, the settings, how to build a version's engine (`loader`) and its
    deployment (`deploy`), each version's series (`version_metrics`), and `on_switch(name, version)`,
    told when the answers of a model (version None: of every version of it) may change, so the response
    cache drops them; `prepare(slot, dep)`, awaited on a new version before its warm-up (its LoRA
    adapters, server/serving/adapters.py): what it raises fails the load. Runs on the event loop that
    creates it."""

    def __init__(
        self,
        models: ModelRegistry,
        settings: ServerSettings,
        loader: VersionLoader,
        deploy: Callable[[ModelSpec, EngineProtocol], Deployment],
        version_metrics: Callable[[str, str], VersionMetrics],
        on_switch: Callable[[str, str | None], None],
        prepare: Callable[[ModelSlot, Deployment], Awaitable[None]] | None = None,
    ) -> None:
        self._models = models
        self._settings = settings
        self._loader = loader
        self._deploy = deploy
        self._version_metrics = version_metrics
        self._on_switch = on_switch
        self._prepare = prepare
        self._loop = asyncio.get_running_loop()
        self._retiring: dict[str, asyncio.Task] = {}  # name@version -> its drain-then-unload task
        self._loads: set[asyncio.Task[Deployment]] = set()
        self._loading: str | None = None  # ref of the version being loaded (one at a time)

    # -- load ----------------------------------------------------------------------------------------
    def start_load(self, name: str, version: str, path: str | None, kv_bytes: int | None,
                   probe: Probe) -> asyncio.Task[Deployment]:  # fmt: skip
        """Begin loading `name@version` beside the running versions. Raises ApiError (400, 404, 409, 507)
        before anything is loaded; the task ends with the version ready, or raises LoadFailed. The load
        goes on when nobody awaits it (a client that hung up)."""
        spec, kv_need = self._check_load(name, version, path, kv_bytes)
        slot = self._models.slot(name)
        self._loading = spec.ref
        slot.loading[version] = spec
        slot.failed.pop(version, None)
        task = self._loop.create_task(self._load(slot, spec, kv_need if kv_bytes is not None else None, probe))

        def done(t: asyncio.Task[Deployment]) -> None:
            slot.loading.pop(version, None)
            self._loading = None
            self._loads.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: a failure is reported by the version's state, not as a warning

        self._loads.add(task)
        task.add_done_callback(done)
        return task

    def _check_load(self, name: str, version: str, path: str | None, kv_bytes: int | None) -> tuple[ModelSpec, int]:
        slot = self._models.slot(name)
        try:
            check_version(version)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc), param="version") from None
        try:
            spec = ModelSpec(name, version, path or version_folder(self._settings.models_dir, name, version, "path"))
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc), param="path") from None
        if path is not None and not Path(path).exists():
            raise ApiError(400, "invalid_request", f"path: {path!r} does not exist", param="path")
        if version in slot.versions or version in slot.loading:
            state = slot.versions[version].state.value if version in slot.versions else "loading"
            raise ApiError(409, "conflict", f"{spec.ref} is already loaded ({state})", param="version")
        if self._loading is not None:
            raise ApiError(409, "conflict", f"{self._loading} is loading; load one version at a time")
        kv = kv_bytes or self._settings.kv_cache_memory or self._running_kv(slot) or memory_check.DEFAULT_KV_BYTES
        refusal = self.memory_refusal(spec, kv, 507)
        if refusal is not None:
            raise refusal
        return spec, kv

    def memory_refusal(self, spec: ModelSpec, kv: int, status: int) -> ApiError | None:
        """The error (`status`, naming what is needed and free) when `spec` with `kv` KV bytes would not fit
        beside the loaded versions; None when it fits. Measured on a loaded version's device (the host's
        memory when none is loaded)."""
        need = memory_check.estimate(spec.path, self._settings.dtype, kv)
        loaded = self._models.primary_or_none()
        have = memory_check.room(loaded.memory() if loaded else None, self._settings.gpu_memory_utilization)
        try:
            memory_check.check(spec.ref, need, have, self._settings.load_memory_headroom)
        except memory_check.InsufficientMemory as exc:
            return ApiError(status, "insufficient_memory", str(exc), headers={"Retry-After": "5"} if status == 503 else None,
                            extra={"needed_bytes": need.total, "available_bytes": have.available})  # fmt: skip
        return None

    # -- on demand (server/serving/pool.py) ------------------------------------------------------------
    async def load_now(self, slot: ModelSlot, probe: Probe) -> Deployment:
        """Load the slot's own model (`slot.spec`) as its promoted version: after an admin load in progress,
        then as an admin load's task (engine in a thread, warm-up, probe). Raises LoadFailed."""
        spec = slot.spec
        assert spec is not None and spec.version == slot.promoted, "only a models folder's model loads on demand"
        while self._loading is not None:
            await asyncio.sleep(0.05)
        self._loading = spec.ref
        slot.loading[spec.version] = spec
        slot.failed.pop(spec.version, None)
        try:
            return await self._load(slot, spec, None, probe)
        finally:
            slot.loading.pop(spec.version, None)
            self._loading = None

    async def unload_now(self, slot: ModelSlot) -> None:
        """Unload every version of `slot` (its in-flight requests finish first, within the drain timeout);
        returns once their engines are gone and the heap's free pages returned. The slot stays: it loads
        again on its next request."""
        slot.set_canary(None, 0)
        slot.previous = None
        # no local here may name a deployment: it would keep that engine alive past its unload
        await asyncio.gather(*(self._unload_version(slot, version) for version in list(slot.versions)))

    async def _unload_version(self, slot: ModelSlot, version: str) -> None:
        dep = slot.versions[version]
        task = self._retiring.pop(dep.spec.ref, None)
        if task is not None:
            task.cancel()
        dep.state = VersionState.DRAINING
        draining = self._drain_then_unload(slot, dep, 0.0)
        del dep
        await draining

    def _running_kv(self, slot: ModelSlot) -> int | None:
        dep = slot.versions.get(slot.promoted)
        return dep.kv_cache_bytes if dep is not None else None

    async def _load(self, slot: ModelSlot, spec: ModelSpec, kv_bytes: int | None, probe: Probe) -> Deployment:
        # Failures are handled outside their `except` blocks: a live exception's traceback holds the frames
        # of the failed load or probe, and with them the engine's memory.
        started = time.perf_counter()
        failure = None
        try:
            engine = await in_fresh_thread(self._loader, spec, kv_bytes)  # server/serving/fresh_thread.py: why
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            await asyncio.to_thread(memory_check.return_freed_memory)
            self._failed(slot, spec, "load_failed", failure)
        dep = self._deploy(spec, engine)
        del engine  # the deployment's worker owns it; no other reference may keep it alive after unload
        dep.timings["load_s"] = round(time.perf_counter() - started, 4)
        slot.versions[spec.version] = dep
        slot.loading.pop(spec.version, None)
        dep.start()
        timeout = self._settings.stall_timeout_s
        kind = "load_failed"
        try:
            if self._prepare is not None:
                await self._prepare(slot, dep)
            kind = "probe_failed"
            await dep.warm_up(timeout)
            await dep.probe(probe, timeout)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            dep.state, dep.error = VersionState.FAILED, failure
            slot.versions.pop(spec.version, None)
            await dep.unload()
            del dep
            await asyncio.to_thread(memory_check.return_freed_memory)
            self._failed(slot, spec, kind, failure)
        dep.state, dep.ready_at = VersionState.READY, time.time()
        dep.metrics.observe_event("loaded")
        log.info("%s loaded and probed in %.2fs (%s)", spec.ref, time.perf_counter() - started, dep.timings)
        return dep

    def _failed(self, slot: ModelSlot, spec: ModelSpec, kind: str, why: str) -> NoReturn:
        slot.remember_failure(spec.version, f"{kind}: {why}")
        self._version_metrics(spec.name, spec.version).observe_event(kind)
        log.error("%s %s: %s", spec.ref, kind.replace("_", " "), why)
        raise LoadFailed(kind, f"{spec.ref}: {why}")

    # -- switches ------------------------------------------------------------------------------------
    def promote(self, name: str, version: str, keep_previous_s: float | None = None) -> ModelSlot:
        """New requests go to `version`; the one promoted so far drains, then unloads after `keep_previous_s`
        (it can be rolled back to until then)."""
        slot = self._models.slot(name)
        dep = self._ready(slot, version)
        if version == slot.promoted:
            raise ApiError(409, "conflict", f"{dep.spec.ref} is already promoted")
        old = slot.versions.get(slot.promoted)  # None: a models folder's model whose promoted version is unloaded
        was = f"{name}@{slot.promoted}"
        slot.set_canary(None, 0)
        slot.promoted, slot.previous = version, old.version if old is not None else None
        if slot.spec is not None:  # a models folder's model: what loads on demand is the promoted version
            slot.spec = dep.spec
        if old is not None:
            self._retire(slot, old, self._settings.keep_previous_s if keep_previous_s is None else keep_previous_s)
        del old
        self._on_switch(name, None)
        dep.metrics.observe_event("promoted")
        log.info("promoted %s (was %s)", dep.spec.ref, was)
        return slot

    def rollback(self, name: str) -> ModelSlot:
        """With a canary: all new requests back to the promoted version, the canary retires. Otherwise:
        back to the previous version while it is still loaded; the current one retires."""
        slot = self._models.slot(name)
        if slot.canary is not None:
            canary = slot.versions[slot.canary]
            slot.set_canary(None, 0)
            self._retire(slot, canary, 0.0)
            canary.metrics.observe_event("rolled_back")
        else:
            previous = slot.versions.get(slot.previous) if slot.previous else None
            if previous is None or previous.state not in (VersionState.DRAINING, VersionState.READY):
                raise ApiError(409, "conflict", f"nothing to roll back to: no canary, and the previous version of {name} "
                               "is no longer loaded (load it again, then promote it)")  # fmt: skip
            task = self._retiring.pop(previous.spec.ref, None)
            if task is not None:
                task.cancel()
            previous.state = VersionState.READY
            current = slot.versions[slot.promoted]
            slot.promoted, slot.previous = previous.version, None
            if slot.spec is not None:
                slot.spec = previous.spec
            self._retire(slot, current, 0.0)
            current.metrics.observe_event("rolled_back")
        self._on_switch(name, None)
        log.info("rolled back %s: %s serves", name, slot.promoted)
        return slot

    def set_canary(self, name: str, version: str, weight: int) -> ModelSlot:
        """Send `weight`% of new requests (that pin no version) to `version`."""
        slot = self._models.slot(name)
        self._ready(slot, version)
        if version == slot.promoted:
            raise ApiError(409, "conflict", f"{name}@{version} is the promoted version; a canary is another one")
        slot.set_canary(version, weight)
        log.info("canary %s@%s at %d%%", name, version, weight)
        return slot

    def remove(self, name: str, version: str) -> None:
        """Retire a version that is not promoted, or forget a failed one."""
        slot = self._models.slot(name)
        if version == slot.promoted:
            raise ApiError(409, "conflict", f"{name}@{version} is promoted; promote another version first")
        if version in slot.loading:
            raise ApiError(409, "conflict", f"{name}@{version} is still loading")
        dep = slot.versions.get(version)
        if dep is None:
            if slot.failed.pop(version, None) is None:
                raise ApiError(404, "not_found", f"{name}@{version} is not loaded")
            return
        if dep.state is VersionState.LOADING:
            raise ApiError(409, "conflict", f"{name}@{version} is still loading (warm-up and probe)")
        if slot.canary == version:
            slot.set_canary(None, 0)
        if slot.previous == version:
            slot.previous = None
        task = self._retiring.pop(dep.spec.ref, None)
        if task is not None:
            task.cancel()
        self._retire(slot, dep, 0.0)

    def _ready(self, slot: ModelSlot, version: str) -> Deployment:
        dep = slot.versions.get(version)
        if dep is None:
            state = "loading" if version in slot.loading else ("failed" if version in slot.failed else "not loaded")
            code = 409 if state != "not loaded" else 404
            raise ApiError(code, "conflict" if code == 409 else "not_found", f"{slot.name}@{version} is {state}")
        if dep.state is not VersionState.READY:
            raise ApiError(409, "conflict", f"{dep.spec.ref} is {dep.state.value}, not ready")
        return dep

    # -- retiring ------------------------------------------------------------------------------------
    def _retire(self, slot: ModelSlot, dep: Deployment, keep_s: float) -> None:
        dep.state = VersionState.DRAINING
        ref = dep.spec.ref
        task = self._loop.create_task(self._drain_then_unload(slot, dep, keep_s))
        self._retiring[ref] = task  # keyed by name: nothing here may keep the deployment alive
        task.add_done_callback(lambda t: self._retiring.pop(ref, None) if self._retiring.get(ref) is t else None)

    async def _drain_then_unload(self, slot: ModelSlot, dep: Deployment, keep_s: float) -> None:
        await dep.drain(self._settings.version_drain_timeout_s)
        if keep_s:
            await asyncio.sleep(keep_s)
        if dep.state is not VersionState.DRAINING or slot.versions.get(dep.version) is not dep:
            return  # revived by a rollback
        # From here on nothing awaits until the version is out of the registry: a rollback sees it gone.
        slot.versions.pop(dep.version)
        if slot.previous == dep.version:
            slot.previous = None
        self._on_switch(dep.name, dep.version)
        dep.metrics.observe_event("unloaded")
        ref = dep.spec.ref
        await dep.unload()
        del dep  # the last reference: the engine (weights, KV cache) is freed here ...
        await asyncio.to_thread(memory_check.return_freed_memory)  # ... and the heap's free pages go back
        log.info("%s drained and unloaded", ref)

    async def close(self) -> None:
        for task in [*self._retiring.values(), *self._loads]:
            task.cancel()
        self._retiring.clear()
