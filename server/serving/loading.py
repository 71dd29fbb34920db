"""Building model versions' engines: the startup versions (`initial_versions`), one version for the
admin API (`load_version`), the single `--model` or the demo model (`build_engine`). Blocking builds
run on a thread that ends with the load (server/serving/fresh_thread.py: why). The only module of the
server that imports the engine package itself (lazily: importing the server loads no torch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.api import EngineProtocol
from engine.kv.events import KVEventSink
from server.config.settings import ServerSettings
from server.config.versions import ModelSpec, catalog_specs, fingerprint, startup_specs
from server.serving.fresh_thread import in_fresh_thread

VersionLoader = Callable[[ModelSpec, "int | None"], EngineProtocol]  # (spec, KV bytes or None) -> engine


def on_demand(settings: ServerSettings, engine: EngineProtocol | None) -> bool:
    """Whether the models folder's models serve by name, loaded on demand (server/serving/pool.py): a
    `models_dir` and no `--model` (nor an engine built by the caller)."""
    return engine is None and not settings.model and bool(settings.models_dir)


async def catalog(settings: ServerSettings) -> list[tuple[ModelSpec, set[str]]]:
    """Every model the models folder serves, with its aliases (the `models` entries first). Reads the folder
    (fingerprints of flat entries) off the loop. Raises ValueError naming the setting at fault."""
    assert settings.models_dir is not None
    return await asyncio.to_thread(catalog_specs, settings.models, settings.models_dir)


def demo_model_path() -> str:
    """The embedded tiny demo model (built on first use, cached)."""
    from engine.testing.make_model import ensure_model

    return str(ensure_model("tiny-llama"))


def open_kv_events(settings: ServerSettings) -> KVEventSink | None:
    """The process's KV-cache events publisher (one socket for every model version's engine), bound
    now; None when events are off. Raises ValueError naming the endpoint it cannot open."""
    from engine.kv.events_zmq import open_publisher

    return open_publisher(settings.kv_events())


def build_engine(settings: ServerSettings, kv_events: KVEventSink | None = None) -> EngineProtocol:
    """Load the model named by the settings (blocking: call it in a thread). Imports torch.
    `kv_events`: where its prefix-cache changes are published (None: nowhere)."""
    from engine import Engine

    return Engine(settings.engine_config(settings.model or demo_model_path()), kv_event_sink=kv_events)


def load_version(settings: ServerSettings, spec: ModelSpec, kv_cache_memory: int | None,
                 kv_events: KVEventSink | None = None) -> EngineProtocol:  # fmt: skip
    """Load one model version with the server's settings (and its own KV budget when given). Blocking."""
    update: dict[str, Any] = {"model": spec.path}
    if kv_cache_memory is not None:
        update["kv_cache_memory"] = kv_cache_memory
    return build_engine(settings.model_copy(update=update), kv_events)


async def initial_versions(
    settings: ServerSettings,
    engine: EngineProtocol | None,
    loader: VersionLoader,
    build_default: Callable[[ServerSettings], EngineProtocol],
) -> list[tuple[ModelSpec, EngineProtocol, set[str]]]:
    """The versions to serve at startup, loaded, each with the other names clients may use for it.
    `engine`: an engine built by the caller (tests) for the single `--model`; `build_default` loads
    `--model` (or the demo model) when no `models` / `models_dir` is set."""
    discover = engine is None and not settings.model  # --model serves; models_dir then only resolves admin loads
    specs = startup_specs(settings.models, settings.models_dir) if discover else []
    if specs or on_demand(settings, engine):  # on demand: only the `models` entries load at startup
        loaded = []
        for spec in specs:
            built = await in_fresh_thread(loader, spec, None)
            loaded.append((spec, built, {built.model_name, spec.path}))
        return loaded
    if engine is None:
        engine = await in_fresh_thread(build_default, settings)
    source = settings.model or getattr(getattr(engine, "config", None), "model", None)
    version: str = settings.model_version or ""
    if not version:
        version = await asyncio.to_thread(fingerprint, source) if source else "0"
    name = settings.served_model_name or engine.model_name
    aliases = {engine.model_name} | ({settings.model} if settings.model else set())
    return [(ModelSpec(name, version, str(source or engine.model_name)), engine, aliases)]
