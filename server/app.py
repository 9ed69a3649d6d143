"""The FastAPI app: routes, error handlers, the request-id and model-lease middleware,
and the engines' lifetime.

A single model's engine loads in a background task started by the lifespan, so the
server answers (with 503s, /health included) while it loads for seconds or minutes; a
server of several models loads each on demand (server/model_pool.py). The lifespan's exit
shuts every engine down. The tasks that optional components registered in the state's
`background` (the dashboard's history) run beside it. If a single model's engine loop
dies, every request in flight has been failed (a 500, or an error event on a stream),
/health and new requests answer 503, and `on_engine_death` hears of it (`pagedserve
serve` then exits, so a supervisor restarts it). The store of /v1/responses opens before
the server answers (a failure to open it stops start-up) and closes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.engines import start_engine
from server import capabilities
from server.admin import info, lora, sleep
from server.anthropic import messages
from server.config import ServeConfig
from server.errors import OpenAIError, RequestIdMiddleware, install_error_handlers
from server.model_pool import LLMFactory, ModelLeases, ModelPool
from server.openai import chat, completions, embeddings, tokenization
from server.openai import models as models_routes
from server.openapi import install_openapi
from server.responses import routes as responses
from server.responses.protocol import INPUT_ITEM_TYPES
from server.responses.store import ResponseStore
from server.state import ServerState

logger = logging.getLogger(__name__)


def build_app(
    config: ServeConfig,
    *,
    llm_factory: LLMFactory = start_engine,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_engine_death: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An app serving `config`; `llm_factory` builds an engine (in a worker thread). A
    single model's server loads it at start-up; `on_load_error` hears of a failure to
    build it and `on_engine_death` of its loop dying (on the event loop, after the
    requests in flight were failed)."""
    state = ServerState(
        config, llm_factory=llm_factory, tool_calling_factory=capabilities.tool_calling
    )
    models = state.models
    store = ResponseStore(config.response_store_path())
    models.on_load_error, models.on_engine_death = on_load_error, on_engine_death

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.open()
        loading = asyncio.create_task(_load_single(models)) if models.single else None
        running = [asyncio.create_task(task()) for task in state.background]
        host = f"[{config.host}]" if ":" in config.host else config.host
        logger.info("OpenAI-compatible API at http://%s:%d/v1", host, config.port)
        try:
            yield
        finally:
            for task in running:
                task.cancel()
            if loading is not None:
                await asyncio.gather(loading, return_exceptions=True)
            await models.shutdown()
            await store.close()

    app = FastAPI(title="pagedserve", version=info.VERSION, lifespan=lifespan)
    app.state.server, app.state.responses = state, store
    app.add_middleware(ModelLeases)
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app, item_tags=INPUT_ITEM_TYPES)
    app.include_router(info.open_router)
    app.include_router(models_routes.router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(messages.router)
    app.include_router(tokenization.router)
    app.include_router(embeddings.router)
    app.include_router(responses.router)
    app.include_router(sleep.router)
    app.include_router(lora.router)
    capabilities.install_dashboard(app)
    install_openapi(app)
    return app


async def _load_single(models: ModelPool) -> None:
    """Load a single model's server's model; a failure was logged and reported by the
    pool (`on_load_error`)."""
    with contextlib.suppress(OpenAIError):
        await models.load(models.first)
