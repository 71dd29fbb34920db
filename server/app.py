"""The ASGI app: `create_app(settings, engine=None)`. The lifespan loads the engine (unless one is
given), starts the worker thread and the warm-up, and on exit aborts what is left and stops the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from server import routes_generate, routes_openai, routes_ops
from server.auth import ApiKeyMiddleware
from server.body_limit import BodyLimitMiddleware
from server.connection_metrics import ConnectionCollector
from server.default_model import with_default_model
from server.errors import install_error_handlers
from server.runtime import Runtime, build_engine
from server.settings import ServerSettings


def create_app(settings: ServerSettings, engine: Any = None) -> FastAPI:
    """The server app. `engine`: an already-built engine (tests inject one); None loads
    `settings.model` (else the default model, else the demo model) during startup. The app owns the
    engine from then on."""
    if engine is None:
        settings = with_default_model(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loaded = engine if engine is not None else await asyncio.to_thread(build_engine, settings)
        runtime = Runtime(settings, loaded)
        app.state.runtime = runtime
        guard = getattr(app.state, "connection_guard", None)  # set by GuardedServer
        if guard is not None:
            runtime.metrics.registry.register(ConnectionCollector(guard))
        runtime.start()
        try:
            yield
        finally:
            await runtime.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(routes_generate.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_ops.router)
    # Added last = runs first: authentication before the body is read.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=settings.accepted_api_keys())
    return app
