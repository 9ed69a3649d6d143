"""The FastAPI app: routes, error handlers, the request-id middleware, and the engine's
lifetime.

The engine loads in a background task started by the lifespan, so the server answers
(with 503s, /health included) while a model loads for seconds or minutes; the lifespan's
exit shuts the engine down. The tasks rooms registered in the state's `background` (the
dashboard's history) run beside it, and another task watches the engine: if its loop
dies, every request in flight has been failed (a 500, or an error event on a stream),
/health and new requests answer 503, and `on_engine_death` hears of it (`pagedserve
serve` then exits, so a supervisor restarts it). The store of /v1/responses opens before
the server answers (a failure to open it stops start-up) and closes last.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import SETTINGS_ERRORS
from server import capabilities, chat, completions, info, responses, sleep, tokenization
from server.anthropic import messages
from server.config import ServeConfig
from server.errors import RequestIdMiddleware, install_error_handlers
from server.state import ServerState

logger = logging.getLogger(__name__)

LLMFactory = Callable[[EngineConfig], AsyncLLM]


def build_app(
    config: ServeConfig,
    *,
    llm_factory: LLMFactory = AsyncLLM.from_config,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_engine_death: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An app serving `config`; `llm_factory` builds the engine (in a worker thread),
    `on_load_error` hears of a failure to build it and `on_engine_death` of its loop dying
    (on the event loop, after the requests in flight were failed)."""
    state = ServerState(config, tool_room=capabilities.tool_calling)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.responses.open()
        loading = asyncio.create_task(_load_engine(state, llm_factory, on_load_error))
        running = [asyncio.create_task(task()) for task in state.background]
        watching = asyncio.create_task(_watch_engine(state, loading, on_engine_death))
        try:
            yield
        finally:
            for task in running:
                task.cancel()
            # A load in progress cannot be interrupted; let it finish so its engine
            # thread can be stopped rather than leaked.
            await loading
            watching.cancel()
            if state.llm is not None:
                await state.llm.shutdown()
            await state.responses.close()

    app = FastAPI(title="pagedserve", version=info.VERSION, lifespan=lifespan)
    app.state.server = state
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)
    app.include_router(info.open_router)
    app.include_router(info.api_router)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(messages.router)
    app.include_router(tokenization.router)
    app.include_router(responses.router)
    app.include_router(sleep.router)
    capabilities.install_dashboard(app)
    return app


async def _load_engine(
    state: ServerState,
    llm_factory: LLMFactory,
    on_load_error: Callable[[BaseException], None] | None,
) -> None:
    config = state.config
    try:
        llm = await asyncio.to_thread(llm_factory, config.engine_config())
    except Exception as exc:
        # Failures the settings caused are reported in one line, without a traceback.
        if isinstance(exc, SETTINGS_ERRORS):
            logger.error("cannot start the engine: %s", exc)
        else:
            logger.exception("cannot start the engine")
        state.load_error = exc
        if on_load_error is not None:
            on_load_error(exc)
        return
    state.llm = llm
    dtype = str(llm.dtype).removeprefix("torch.")
    num_blocks = llm.num_kv_blocks
    logger.info(
        "model %s served as '%s': %s on %s, max_model_len %d, %d KV blocks of %d tokens "
        "(%d tokens of KV capacity)",
        llm.model_name,
        state.model_name,
        dtype,
        llm.device,
        llm.max_model_len,
        num_blocks,
        llm.block_size,
        num_blocks * llm.block_size,
    )
    host = f"[{config.host}]" if ":" in config.host else config.host
    logger.info("OpenAI-compatible API at http://%s:%d/v1", host, config.port)


async def _watch_engine(
    state: ServerState,
    loading: asyncio.Task[None],
    on_engine_death: Callable[[BaseException], None] | None,
) -> None:
    """Once the engine has loaded, wait for its loop to end; if it died, say so and tell
    `on_engine_death`."""
    await asyncio.shield(loading)
    if state.llm is None:
        return
    failure = await state.llm.wait_ended()
    if failure is None:
        return
    logger.error(
        "the engine died (%s: %s): the requests in flight were failed with an error, and "
        "/health and every new request answer 503 from now on",
        type(failure).__name__,
        failure,
    )
    if on_engine_death is not None:
        on_engine_death(failure)
