"""Routing before admission: a request's `model` picks a slot (name, alias or name@version), the slot
picks the promoted version or the canary by its exact share, and the route holds a lease on it."""

from __future__ import annotations

from typing import Any

import pytest

from server.config.versions import ModelSpec
from server.http.errors import ApiError
from server.serving.deployment import Lease, VersionState
from server.serving.registry import ModelRegistry, ModelSlot


class FakeDeployment:
    """What the registry reads of a Deployment."""

    def __init__(self, name: str, version: str) -> None:
        self.spec = ModelSpec(name, version, f"/models/{name}/{version}")
        self.name, self.version = name, version
        self.state = VersionState.READY
        self.alive = True
        self.leases = 0
        self.max_model_len, self.loaded_at, self.engine_desc = 128, 0.0, {"dtype": "float32", "device": "cpu"}
        self.timings: dict[str, float] = {}
        self.error = None
        self.adapters: dict = {}  # LoRA adapters by name (none here)

    def busy(self) -> int:
        return self.leases

    @property
    def accepting(self) -> bool:
        return self.state is VersionState.READY and self.alive

    def acquire(self) -> Lease:
        return Lease(self)  # type: ignore[arg-type]


def _slot(*versions: str) -> tuple[ModelSlot, dict[str, Any]]:
    deps = {v: FakeDeployment("tiny", v) for v in versions}
    slot = ModelSlot("tiny", {"tiny-llama"}, dict(deps), promoted=versions[0])  # type: ignore[arg-type]
    return slot, deps


@pytest.mark.parametrize("weight", [0, 1, 25, 33, 50, 99, 100])
def test_canary_share_is_exact_on_every_window(weight):
    slot, _ = _slot("v1", "v2")
    slot.set_canary("v2", weight)
    picks = [slot.pick(None).version for _ in range(1000)]
    assert picks.count("v2") == 10 * weight
    for start in range(0, 1000, 100):  # every 100 consecutive requests: exactly `weight` to the canary
        assert picks[start:start + 100].count("v2") == weight


def test_pins_and_versions_that_do_not_take_requests():
    slot, deps = _slot("v1", "v2")
    slot.set_canary("v2", 100)
    assert slot.pick("v1").version == "v1"  # a pin wins over the canary
    deps["v2"].state = VersionState.DRAINING  # a canary that stops taking requests gets none
    assert {slot.pick(None).version for _ in range(10)} == {"v1"}
    with pytest.raises(ApiError) as e:
        slot.pick("v2")
    assert e.value.status == 404 and "draining" in e.value.message and e.value.param == "model"
    with pytest.raises(ApiError) as e:
        slot.pick("v9")
    assert e.value.status == 404 and "not loaded" in e.value.message
    deps["v1"].alive = False
    with pytest.raises(ApiError) as e:
        slot.pick(None)
    assert e.value.status == 503


def test_resolve_names_aliases_and_pins():
    registry = ModelRegistry()
    a, b = FakeDeployment("alpha", "v1"), FakeDeployment("beta", "7")
    registry.add_slot(a, {"alpha", "alpha-folder"})  # type: ignore[arg-type]
    registry.add_slot(b, set())  # type: ignore[arg-type]
    assert registry.resolve(None) == (registry.slots["alpha"], None)  # the first is the default
    assert registry.resolve("alpha-folder") == (registry.slots["alpha"], None)
    assert registry.resolve("beta@7") == (registry.slots["beta"], "7")
    assert registry.resolve("alpha-folder@v1") == (registry.slots["alpha"], "v1")
    for unknown in ("gamma", "gamma@v1", "@v1"):
        with pytest.raises(ApiError) as e:
            registry.resolve(unknown)
        assert e.value.status == 404 and e.value.param == "model"
    slot, lease = registry.acquire("beta")
    assert slot.name == "beta" and b.leases == 1
    lease.release()
    lease.release()  # idempotent
    assert b.leases == 0
    assert registry.promoted() == [a, b]
    with pytest.raises(ApiError) as e:
        registry.slot("gamma")
    assert e.value.status == 404


def test_roles_and_failures_listed():
    slot, _ = _slot("v1", "v2", "v3")
    slot.previous, slot.canary, slot.weight = "v3", "v2", 10
    assert [slot.role(v) for v in ("v1", "v2", "v3", "v4")] == ["promoted", "canary", "previous", "candidate"]
    for i in range(12):
        slot.remember_failure(f"bad{i}", "probe_failed: NaN")
    assert list(slot.failed) == [f"bad{i}" for i in range(4, 12)]  # the newest 8
    states = {row["version"]: row["state"] for row in slot.describe()}
    assert states["bad11"] == "failed" and states["v2"] == "ready"
