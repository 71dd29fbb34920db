"""Which loaded version serves a request: one `ModelSlot` per model name holds its loaded versions, the
promoted one, the previous one (kept for rollback while loaded) and a canary with its weight.

Routing happens before admission: a request's `model` field names a slot (or pins `name@version`), or a
LoRA adapter a version of a slot holds (or pins `adapter@version`; the request then runs on it: the
lease carries it), the slot picks a version, and the route holds a lease on it
(server/serving/deployment.py). An adapter's requests take the same split and pins as the model's:
every version of a model holds the same adapters (server/serving/adapters.py). The canary split is
deterministic: of every 100 consecutive requests, exactly `weight` go to the canary (a credit counter,
not a coin), so the share is exact on any window and reproducible in tests. Plain bookkeeping on the
event loop: loading, draining and unloading engines is server/serving/rollout.py's job.

A name a models folder serves (server/serving/pool.py) has a slot from the start, loaded or not: its
`spec` is what loads on demand, and the slot may hold no version at all (unloaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.config.versions import ModelSpec, split_ref
from server.http.errors import ApiError
from server.serving.deployment import Deployment, Lease, VersionState

_FAILED_KEPT = 8  # failed loads listed per name (the newest)


@dataclass
class ModelSlot:
    """One model name and its versions."""

    name: str
    aliases: set[str]  # other names accepted in `model` (folder name, path)
    versions: dict[str, Deployment] = field(default_factory=dict)  # loaded: loading (probe), ready, draining
    promoted: str = ""  # version new requests go to
    previous: str | None = None  # the version promoted before; rollback returns to it while it is loaded
    canary: str | None = None  # a ready version that gets `weight`% of new requests
    weight: int = 0  # 0-100
    loading: dict[str, ModelSpec] = field(default_factory=dict)  # engines being built
    failed: dict[str, str] = field(default_factory=dict)  # version -> why its load or probe failed
    spec: ModelSpec | None = None  # what loads on demand (a models folder's model); None: loaded at startup only
    last_used: float = 0.0  # time.monotonic() of its last request (least recently used unloads first)
    waiters: int = 0  # requests waiting for it to load: it is not unloaded while any waits
    _credit: float = 0.0  # canary share owed: +weight/100 per request, -1 per request sent to the canary

    def role(self, version: str) -> str:
        if version == self.promoted:
            return "promoted"
        if version == self.canary:
            return "canary"
        if version == self.previous:
            return "previous"
        return "candidate"

    def pick(self, pinned: str | None) -> Deployment:
        """The version a new request goes to. Raises ApiError 404 (pinned version not served) or 503."""
        if pinned is not None:
            dep = self.versions.get(pinned)
            if dep is None or not dep.accepting:
                state = "not loaded" if dep is None else dep.state.value
                raise ApiError(404, "model_not_found", f"model {self.name}@{pinned} is not served ({state}); see "
                               "/v1/models", param="model")  # fmt: skip
            return dep
        canary = self.versions.get(self.canary) if self.canary else None
        if canary is not None and canary.accepting and self.weight:
            self._credit += self.weight / 100
            if self._credit >= 1.0 - 1e-9:
                self._credit -= 1.0
                return canary
        dep = self.versions.get(self.promoted)
        if dep is None or not dep.accepting:
            raise ApiError(503, "unavailable", f"model {self.name} has no ready version", headers={"Retry-After": "1"})
        return dep

    def serves(self, pinned: str | None) -> bool:
        """Whether pick(pinned) finds a version taking requests now (nothing to load or wait for)."""
        dep = self.versions.get(pinned or self.promoted)
        return dep is not None and dep.accepting

    def idle(self) -> bool:
        """Loaded, every version ready (or draining) with nothing in flight, and no request waiting."""
        return bool(self.versions) and not self.loading and not self.waiters and all(
            dep.busy() == 0 and dep.state is not VersionState.LOADING for dep in self.versions.values()
        )

    def set_canary(self, version: str | None, weight: int) -> None:
        self.canary, self.weight, self._credit = version, weight, 0.0

    def remember_failure(self, version: str, why: str) -> None:
        self.failed.pop(version, None)
        self.failed[version] = why
        while len(self.failed) > _FAILED_KEPT:
            self.failed.pop(next(iter(self.failed)))

    def describe(self) -> list[dict[str, Any]]:
        """Every version of this name: loaded ones, those loading and the failed ones."""
        rows = [version_row(self, dep) for dep in self.versions.values()]
        rows += [{"id": spec.ref, "version": v, "state": VersionState.LOADING.value, "role": "candidate",
                  "path": spec.path} for v, spec in self.loading.items()]  # fmt: skip
        rows += [{"id": f"{self.name}@{v}", "version": v, "state": VersionState.FAILED.value, "role": "candidate",
                  "error": why} for v, why in self.failed.items() if v not in self.versions]  # fmt: skip
        return rows


def version_row(slot: ModelSlot, dep: Deployment) -> dict[str, Any]:
    row: dict[str, Any] = {"id": dep.spec.ref, "version": dep.version, "state": dep.state.value,
                           "role": slot.role(dep.version), "path": dep.spec.path, "in_flight": dep.busy(),
                           "max_model_len": dep.max_model_len, "loaded_at": int(dep.loaded_at), **dep.engine_desc}
    if dep.version == slot.canary:
        row["weight"] = slot.weight
    if dep.timings:
        row["timings"] = dict(dep.timings)
    if dep.error:
        row["error"] = dep.error
    return row


class ModelRegistry:
    """Every model name served, in order: the first is the default for requests that name none."""

    def __init__(self) -> None:
        self.slots: dict[str, ModelSlot] = {}

    def add_slot(self, dep: Deployment, aliases: set[str], on_demand: bool = False) -> ModelSlot:
        """A new name whose first (promoted) version is `dep`; `on_demand`: it may be unloaded and loaded
        again (a models folder's model)."""
        slot = ModelSlot(dep.name, aliases - {dep.name}, {dep.version: dep}, promoted=dep.version,
                         spec=dep.spec if on_demand else None)  # fmt: skip
        self.slots[dep.name] = slot
        return slot

    def add_unloaded(self, spec: ModelSpec, aliases: set[str]) -> ModelSlot:
        """A new name that loads `spec` on its first request."""
        slot = ModelSlot(spec.name, aliases - {spec.name}, promoted=spec.version, spec=spec)
        self.slots[spec.name] = slot
        return slot

    @property
    def default(self) -> ModelSlot:
        return next(iter(self.slots.values()))

    @property
    def primary(self) -> Deployment:
        """The default model's promoted version (what single-model code and /health report), else another
        model's when the default is not loaded. Raises ApiError 503 when no model is loaded."""
        dep = self.primary_or_none()
        if dep is None:
            raise ApiError(503, "unavailable", "no model is loaded yet (models load on their first request; see "
                           "/v1/models)", headers={"Retry-After": "1"})  # fmt: skip
        return dep

    def primary_or_none(self) -> Deployment | None:
        promoted = self.promoted()
        return promoted[0] if promoted else None

    def slot(self, name: str) -> ModelSlot:
        """The slot called `name` (admin API). Raises ApiError 404."""
        slot = self.slots.get(name)
        if slot is None:
            raise ApiError(404, "model_not_found", f"model {name!r} is not configured; models: {self.names()}")
        return slot

    def names(self) -> list[str]:
        return sorted(self.slots)

    def resolve(self, model: str | None) -> tuple[ModelSlot, str | None]:
        """The slot a request's `model` names, and the version it pins (None: the slot picks).
        Raises ApiError 404."""
        slot, pinned, _ = self.route(model)
        return slot, pinned

    def route(self, model: str | None) -> tuple[ModelSlot, str | None, str | None]:
        """(slot, pinned version, adapter name or None) of a request's `model`. A model's name wins over an
        adapter's; `adapter@version` pins the adapter to that version of its base model."""
        if model is None:
            return self.default, None, None
        for candidate, pinned in ((model, None), split_ref(model)):
            for slot in self.slots.values():
                if candidate == slot.name or candidate in slot.aliases:
                    return slot, pinned, None
        for candidate, pinned in ((model, None), split_ref(model)):
            adapter_slot = self.adapter_slot(candidate)
            if adapter_slot is not None:
                return adapter_slot, pinned, candidate
        raise ApiError(404, "model_not_found", f"model: {model!r} is not served here; models: {self.names()} (see "
                       "/v1/models)", param="model")  # fmt: skip

    def is_model_name(self, name: str) -> bool:
        """Whether `name` is a slot's name or alias (a model name wins over an adapter's)."""
        return any(name == slot.name or name in slot.aliases for slot in self.slots.values())

    def adapter_slot(self, name: str) -> ModelSlot | None:
        """The slot one of whose versions holds a LoRA adapter called `name`; None when none does."""
        if self.is_model_name(name):
            return None
        for slot in self.slots.values():
            if any(name in dep.adapters for dep in slot.versions.values()):
                return slot
        return None

    def acquire(self, model: str | None) -> tuple[ModelSlot, Lease]:
        """Route a new request: its slot and a lease on the version that serves it (on the adapter
        `model` names, when it names one)."""
        slot, pinned, adapter = self.route(model)
        dep = slot.pick(pinned)
        return slot, dep.acquire() if adapter is None else dep.acquire(adapter)

    def deployments(self) -> list[tuple[ModelSlot, Deployment]]:
        return [(slot, dep) for slot in self.slots.values() for dep in slot.versions.values()]

    def promoted(self) -> list[Deployment]:
        """The promoted version of every name that has it loaded (what readiness is about)."""
        return [slot.versions[slot.promoted] for slot in self.slots.values() if slot.promoted in slot.versions]

    def cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models: one card per name (its promoted version's), listing every version loading or loaded
        with its state and role; failed loads and paths only show in the admin API. Each card carries
        tokenmill's `state` and llama.cpp's router `status` ({"value": loaded | loading | unloaded}, with
        `failed` and the reason after a failed load); a name not loaded has no max_model_len yet."""
        out = []
        for slot in self.slots.values():
            dep = slot.versions.get(slot.promoted)
            if dep is None:
                out.append(unloaded_card(slot, created))
                continue
            versions = []
            for row in slot.describe():
                if row["state"] == VersionState.FAILED.value:
                    continue
                entry = {"id": row["id"], "version": row["version"], "state": row["state"], "role": row["role"]}
                if "weight" in row:
                    entry["weight"] = row["weight"]
                versions.append(entry)
            out.append({"id": slot.name, "object": "model", "created": created, "owned_by": "tokenmill",
                        "root": slot.name, "max_model_len": dep.max_model_len, "version": dep.version,
                        "state": dep.state.value, "status": {"value": _STATUS[dep.state]},
                        "versions": versions})  # fmt: skip
            out += [adapter_card(slot, dep, info, created) for info in dep.adapters.values()]
        return out


_STATUS = {VersionState.LOADING: "loading", VersionState.READY: "loaded", VersionState.DRAINING: "loaded",
           VersionState.FAILED: "unloaded", VersionState.UNLOADED: "unloaded"}  # tokenmill state -> llama.cpp's


def unloaded_card(slot: ModelSlot, created: int) -> dict[str, Any]:
    """/v1/models card of a name whose promoted version is not loaded (loading, or not loaded yet)."""
    state = VersionState.LOADING if slot.promoted in slot.loading else VersionState.UNLOADED
    status: dict[str, Any] = {"value": _STATUS[state]}
    why = slot.failed.get(slot.promoted)
    if why is not None and state is VersionState.UNLOADED:
        status.update(failed=True, error=why)
    return {"id": slot.name, "object": "model", "created": created, "owned_by": "tokenmill", "root": slot.name,
            "version": slot.promoted, "state": state.value, "status": status, "versions": []}


def adapter_card(slot: ModelSlot, dep: Deployment, info: Any, created: int) -> dict[str, Any]:
    """/v1/models card of a LoRA adapter (vLLM's shape: `parent` is the base model, `root` the path)."""
    return {"id": info.name, "object": "model", "created": created, "owned_by": "tokenmill", "root": info.path,
            "parent": slot.name, "max_model_len": dep.max_model_len, "lora_rank": info.rank}
