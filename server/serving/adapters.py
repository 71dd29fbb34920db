"""LoRA adapters across a model's versions: every loaded version of a model holds the same adapters, so
an adapter's requests follow the version machinery (promote, canary share, rollback, `adapter@version`
pins) exactly as the model's do.

- The load and unload endpoints (server/api/lora.py) change every loaded version, all or none.
- A version the admin API loads (server/serving/rollout.py) is matched to the promoted version before
  its warm-up (`match`): each adapter the promoted version serves is read again from its path by the
  new version's engine, against the new base weights; a start-up adapter unloaded since is unloaded
  from it. An adapter that does not load there (an adapter for another base model: other layer
  count or projection sizes; its folder gone) fails that version's load, naming the adapter: a version
  never goes live without an adapter clients use, and an adapter never runs on weights it was not
  read against.

`AdapterSync.lock` orders these changes: a load or unload while a version loads is either seen by its
match or applied to it as to any loaded version, never lost between the two.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from engine.api import EngineProtocol, LoraError, LoraInfo
from server.serving.deployment import Deployment

CALL_TIMEOUT_S = 120.0  # a worker that takes longer to read one adapter is stuck or gone


class AdapterMismatch(Exception):
    """An adapter the promoted version serves did not load on a new version."""


async def on_worker(dep: Deployment, fn: Callable[[EngineProtocol], LoraInfo]) -> LoraInfo:
    """fn(engine) on the version's worker thread between two steps. Raises what fn raised (LoraError),
    or TimeoutError after CALL_TIMEOUT_S."""
    return await asyncio.wait_for(asyncio.wrap_future(dep.worker.call(fn)), CALL_TIMEOUT_S)


class AdapterSync:
    """One per runtime; see the module docstring. Runs on the event loop."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()

    async def match(self, source: Deployment | None, target: Deployment) -> None:
        """Give `target` (a new version, not serving yet) exactly the adapters `source` (its model's
        promoted version) serves, each from the path `source` read it from. Raises AdapterMismatch naming
        the adapter that does not load."""
        async with self.lock:
            want = dict(source.adapters) if source is not None else {}
            for name in [n for n, info in target.adapters.items() if n not in want or info.path != want[n].path]:
                target.adapters.pop(name)  # unloaded (or reloaded from another folder) since the start-up
                await on_worker(target, functools.partial(_unload, name=name))
            for name, info in want.items():
                if name in target.adapters:
                    continue  # a start-up adapter its engine read already, from the same folder
                try:
                    loaded = await on_worker(target, functools.partial(_load, name=name, path=info.path))
                except LoraError as exc:
                    raise AdapterMismatch(f"LoRA adapter {name!r} ({info.path}) does not load on {target.spec.ref}: "
                                          f"{exc.message}; unload it first to change the base model") from None
                target.adapters[name] = loaded


def _load(engine: EngineProtocol, name: str, path: str) -> LoraInfo:
    return engine.load_lora(name, path)


def _unload(engine: EngineProtocol, name: str) -> LoraInfo:
    return engine.unload_lora(name)
