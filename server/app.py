"""The ASGI app: `create_app(settings, engine=None, loader=None)`. The lifespan loads the startup model
versions (unless an engine is given), opens the feedback database, starts the workers and the warm-up,
and on exit aborts what is left and stops every worker.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from engine.kv.events import KVEventSink
from server.api import admin as routes_admin
from server.api import feedback as routes_feedback
from server.api import fleet as routes_fleet
from server.api import generate as routes_generate
from server.api import lora as routes_lora
from server.api import messages as routes_messages
from server.api import openai as routes_openai
from server.api import ops as routes_ops
from server.api import responses as routes_responses
from server.api import tgi as routes_tgi
from server.api import tokenize as routes_tokens
from server.config.default_model import with_default_model
from server.config.settings import ServerSettings
from server.http.auth import LORA_PATHS, AdminKeyMiddleware, ApiKeyMiddleware
from server.http.body_limit import BodyLimitMiddleware
from server.http.error_log import ErrorLogMiddleware
from server.http.errors import InternalErrorMiddleware, install_error_handlers
from server.ops.connection_metrics import ConnectionCollector
from server.ops.feedback import FeedbackStore
from server.ops.kv_events_metrics import KVEventsCollector
from server.serving import loading
from server.serving.runtime import Runtime


def create_app(settings: ServerSettings, engine: Any = None, loader: loading.VersionLoader | None = None,
               kv_events: KVEventSink | None = None) -> FastAPI:  # fmt: skip
    """The server app. `engine`: an already-built engine (tests inject one) for the single model; None
    loads `settings.models` / `models_dir`, else `settings.model` (else the default model, else the demo
    model), during startup. `loader` builds the engine of a version the admin API loads (default: the
    real engine, from the version's path with these settings). The app owns every engine from then on.
    `kv_events`: the KV-events publisher `engine` was built with (the CLI opens it first); None: the
    lifespan opens one when the settings ask for it. The app closes it."""
    if engine is None:
        settings = with_default_model(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events = kv_events if kv_events is not None else loading.open_kv_events(settings)  # before any engine loads
        load = loader or functools.partial(loading.load_version, settings, kv_events=events)
        build = functools.partial(loading.build_engine, kv_events=events)
        try:
            initial = await loading.initial_versions(settings, engine, load, build)
            served = await loading.catalog(settings) if loading.on_demand(settings, engine) else None
            feedback = await asyncio.to_thread(FeedbackStore.open, settings.feedback_db) if settings.feedback_db else None
            runtime = Runtime(settings, initial, load, feedback, served)
            del initial  # the workers own the engines: nothing else may keep one alive once its version unloads
            app.state.runtime = runtime
            guard = getattr(app.state, "connection_guard", None)  # set by GuardedServer
            if guard is not None:
                runtime.metrics.registry.register(ConnectionCollector(guard))
            if events is not None:
                runtime.metrics.registry.register(KVEventsCollector(events.stats))
            runtime.start()
            try:
                yield
            finally:
                await runtime.close()
        finally:
            if events is not None:
                await asyncio.to_thread(events.close)

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(routes_generate.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_feedback.router)
    app.include_router(routes_ops.router)
    app.include_router(routes_tokens.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_messages.router)
    app.include_router(routes_tgi.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_fleet.router)
    app.include_router(routes_lora.router)
    # Added last = runs first: authentication before the body is read.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=settings.accepted_api_keys(),
                       admin_paths=LORA_PATHS if settings.accepted_admin_keys() else ())  # fmt: skip
    app.add_middleware(AdminKeyMiddleware, keys=settings.accepted_admin_keys())
    app.add_middleware(InternalErrorMiddleware)  # any other exception: a 500 that closes the connection
    app.add_middleware(ErrorLogMiddleware)  # outermost: sees every error answer, the middlewares' too
    return app
