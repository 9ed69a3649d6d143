"""The models one server serves: each configured model's engine, loaded and unloaded.

A server serves one model (the `model` setting: loaded at start-up, and a failure to load
or an engine's death ends the process as before) or several (`models`: none loaded at
start-up). A request names its model; `acquire` finds it (a 404 for an unknown name),
loads it if it is not loaded (`autoload`), and counts the request as a user until the
app's `ModelLeases` middleware releases it when the response has been sent.

A model unloads on `unload` (POST /models/unload), when loading another would pass
`max_loaded_models` or the machine's available memory (the least recently used idle
model first), and `keep_alive` seconds after its last request ended (Ollama's meaning:
`math.inf` pins it, 0 unloads it as soon as it is idle; a request may set it for its
model). An unloaded model's engine is shut down and collected, and the C heap trimmed,
so its memory goes back to the machine.

Invariants: loads and unloads run one at a time, under `_lock`, each in a task of its own
that a client's leaving cannot cancel half-way; a model with users is never unloaded (an
unload waits for them to finish; LRU picks idle models only); a loaded model's `llm` is
set, an unloaded one's None, and requests arriving while it unloads wait and load it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_llm import AsyncLLM
from engine.errors import SETTINGS_ERRORS, AdapterError, ModelLoadError
from engine.heap import trim_heap
from engine.model.loader import resolve_model_source, weights_bytes
from engine.pooling.async_pooler import AsyncPooler
from server.admission import Deadline
from server.errors import OpenAIError, deadline_exceeded
from server.served_model import ModelState, ServedModel

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request.intake import SpecialTokens
    from server.config import ServeConfig
    from server.conversation import ToolCalling

# The tools component's entry point (`server.capabilities.tool_calling`): the `tool_call_parser`
# setting, the chat template and the special tokens in; None where the component is missing.
ToolCallingFactory = Callable[[str, "str | None", "SpecialTokens"], "ToolCalling | None"]

logger = logging.getLogger(__name__)

LLMFactory = Callable[["EngineConfig"], "AsyncLLM | AsyncPooler"]
# The ASGI scope key under which a request's held models' release calls wait.
LEASES = "pagedserve.model_leases"
GiB = 1024**3


class ModelPool:
    """The server's models by name, and the loads and unloads between their states."""

    def __init__(
        self, config: ServeConfig, llm_factory: LLMFactory, tool_calling_factory: ToolCallingFactory
    ) -> None:
        self.single = config.models is None
        self.autoload = config.autoload
        self.max_loaded = config.max_loaded_models
        self._factory = llm_factory
        self._lock = asyncio.Lock()
        self._watching: set[asyncio.Task[None]] = set()
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.on_engine_death: Callable[[BaseException], None] | None = None
        self.models: dict[str, ServedModel] = {}
        model_tool_calling = functools.partial(tool_calling_factory, config.tool_call_parser)
        entries = [None] if config.models is None else config.models
        for entry in entries:
            engine_config = config.engine_config(entry)
            root = _root_name(engine_config.model)
            name = root if entry is None else entry.name
            if entry is None and config.served_model_name:
                name = config.served_model_name
            keep_alive = config.keep_alive
            if entry is not None and entry.keep_alive is not None:
                keep_alive = entry.keep_alive
            self.models[name] = ServedModel(
                name, root, engine_config, keep_alive, model_tool_calling,
                adapters=dict(engine_config.lora_modules),
            )  # fmt: skip

    @property
    def first(self) -> ServedModel:
        """The first configured model (a single model's server: its only one)."""
        return next(iter(self.models.values()))

    def loaded(self) -> list[ServedModel]:
        return [model for model in self.models.values() if model.llm is not None]

    def engines(self) -> list[tuple[str, AsyncLLM | AsyncPooler]]:
        """Each loaded model's name and engine."""
        return [(model.name, model.llm) for model in self.models.values() if model.llm is not None]

    def find(self, name: str) -> ServedModel:
        """The model requests call `name`, or a 404 in the endpoint's format. A single
        model answers to its served name and its own; while it first loads, a 503."""
        if self.single:
            model = self.first
            if model.llm is None and model.state is not ModelState.UNLOADED:
                model.ready_llm()  # raises: still loading, or failed to load
            if name in (model.name, model.root):
                return model
            raise OpenAIError(
                404,
                f"the model '{name}' does not exist; this server serves '{model.name}'",
                param="model",
                code="model_not_found",
            )
        found = self.models.get(name)
        if found is None:
            served = ", ".join(f"'{known}'" for known in self.models)
            raise OpenAIError(
                404,
                f"the model '{name}' does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return found

    def resolve(self, name: str) -> tuple[ServedModel, str | None] | None:
        """The model requests call `name` and None, or the model whose LoRA adapter it is
        and the adapter; None if neither (a single model still loading: a 503)."""
        for model in self.models.values():
            if name in model.adapters:
                return model, name
        try:
            return self.find(name), None
        except OpenAIError as exc:
            if exc.status == 404:
                return None
            raise

    def lookup(self, name: str) -> tuple[ServedModel, str | None]:
        """`resolve`, or a 404 naming every model and adapter served."""
        found = self.resolve(name)
        if found is not None:
            return found
        names = [name for model in self.models.values() for name in (model.name, *model.adapters)]
        served = ", ".join(f"'{known}'" for known in names)
        raise OpenAIError(
            404,
            f"the model '{name}' does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    async def acquire(
        self, name: str, keep_alive: float | None = None, deadline: Deadline | None = None
    ) -> tuple[ServedModel, str | None]:
        """The loaded model named `name` (or whose LoRA adapter `name` is, and the adapter),
        held for one more user (`release` lets go), loading it first if need be (within
        `deadline`); `keep_alive` becomes its own."""
        model, adapter = self.lookup(name)
        if keep_alive is not None:
            model.keep_alive = keep_alive
        if model.llm is None or model.unloading:
            if model.llm is None and model.loading is None and not self.autoload:
                raise OpenAIError(
                    503,
                    f"the model '{model.name}' is not loaded (autoload is off): load it "
                    "with POST /models/load",
                    type="service_unavailable",
                    code="model_not_loaded",
                )
            try:
                async with asyncio.timeout(None if deadline is None else deadline.remaining()):
                    await self.load(model)
            except TimeoutError:
                assert deadline is not None
                raise deadline_exceeded(deadline.timeout, 0) from None
        model.hold()
        return model, adapter

    async def lease(
        self, request: Request, name: str, keep_alive: float | None, deadline: Deadline | None
    ) -> tuple[ServedModel, str | None]:
        """`acquire`, released by `ModelLeases` once the response to `request` is sent."""
        model, adapter = await self.acquire(name, keep_alive, deadline)
        request.scope.setdefault(LEASES, []).append(functools.partial(self.release, model))
        return model, adapter

    async def add_adapter(self, model: ServedModel, name: str, path: str) -> None:
        """Load the LoRA adapter in `path` as `name` on `model` (loaded first if need be);
        AdapterError naming what is wrong with it. It stays with the model's later loads."""
        await self.load(model)
        model.hold()
        try:
            await model.generator("LoRA adapters").load_lora(name, path)
            model.adapters[name] = path
        finally:
            self.release(model)

    async def remove_adapter(self, model: ServedModel, name: str) -> None:
        """Stop serving `model`'s adapter `name` (its requests in flight finish with it)."""
        model.adapters.pop(name, None)
        if isinstance(model.llm, AsyncLLM):
            with contextlib.suppress(AdapterError):  # an engine that never had it
                await model.llm.unload_lora(name)

    def release(self, model: ServedModel) -> None:
        """One user of `model` is done; the last one starts its keep_alive."""
        if not model.release():
            return
        if model.keep_alive == 0:
            self._start_unload(model)
        elif math.isfinite(model.keep_alive):
            loop = asyncio.get_running_loop()
            model.expire_at(loop.call_later(model.keep_alive, self._start_unload, model))

    async def load(self, model: ServedModel) -> None:
        """Load `model` unless it is loaded; wait for a load in progress. Raises an
        OpenAIError saying why it could not load."""
        if model.llm is not None and not model.unloading:
            return
        if model.loading is None:
            model.loading = asyncio.create_task(self._load(model))
            model.loading.add_done_callback(_retrieve)
        await asyncio.shield(model.loading)

    async def unload(self, model: ServedModel) -> float:
        """Unload `model` once its requests in flight have finished; the seconds it took
        (0 if it was not loaded)."""
        task = asyncio.create_task(self._unload_when_idle(model))
        return await asyncio.shield(task)

    async def shutdown(self) -> None:
        """Wait for loads in progress (they cannot be interrupted) and stop every engine."""
        for model in self.models.values():
            if model.loading is not None:
                await asyncio.gather(model.loading, return_exceptions=True)
            model.expire_at(None)
        for task in list(self._watching):
            task.cancel()
        for model in self.loaded():
            assert model.llm is not None
            await model.llm.shutdown()

    async def _load(self, model: ServedModel) -> None:
        try:
            async with self._lock:
                if model.llm is not None:
                    return
                started = time.monotonic()
                try:
                    await self._make_room(model)
                    config = model.config.model_copy(update={"lora_modules": dict(model.adapters)})
                    llm = await asyncio.to_thread(self._factory, config)
                except Exception as exc:
                    self._load_failed(model, exc)
                    raise _load_error(model, exc) from exc
                model.llm, model.load_error = llm, None
                model.load_seconds = time.monotonic() - started
                model.last_used = time.monotonic()
                watch = asyncio.create_task(self._watch(model, llm))
                self._watching.add(watch)
                watch.add_done_callback(self._watching.discard)
                _log_loaded(model, llm)
        finally:
            model.loading = None

    def _load_failed(self, model: ServedModel, exc: Exception) -> None:
        model.load_error = exc
        # Failures the settings caused are reported in one line, without a traceback.
        if isinstance(exc, (*SETTINGS_ERRORS, OpenAIError)):
            logger.error("cannot start the engine of '%s': %s", model.name, exc)
        else:
            logger.exception("cannot start the engine of '%s'", model.name)
        if self.single and self.on_load_error is not None:
            self.on_load_error(exc)

    async def _make_room(self, model: ServedModel) -> None:
        """Unload idle models, least recently used first, while loading `model` would pass
        `max_loaded_models` or the memory available; a 503 with the figures if it cannot."""
        while self.max_loaded is not None and len(self.loaded()) >= self.max_loaded:
            victim = self._least_recently_used()
            if victim is None:
                raise OpenAIError(
                    503,
                    f"cannot load '{model.name}': {len(self.loaded())} models are loaded "
                    f"(max_loaded_models) and each has requests in flight; retry later",
                    type="service_unavailable",
                    code="models_busy",
                )
            await self._unload(victim)
        if model.config.device == "cuda":
            return
        try:
            weights = weights_bytes(model.config.model)
        except ModelLoadError:
            return  # the load itself says what is wrong
        kv = model.config.kv_cache_memory or 0
        while weights + kv > psutil.virtual_memory().available:
            victim = self._least_recently_used()
            if victim is None:
                break
            await self._unload(victim)
        available = psutil.virtual_memory().available
        if weights > available:
            raise OpenAIError(
                503,
                f"cannot load '{model.name}': its weights take {weights / GiB:.2f} GiB and "
                f"{available / GiB:.2f} GiB of memory is available",
                type="service_unavailable",
                code="insufficient_memory",
            )

    def _least_recently_used(self) -> ServedModel | None:
        idle = [model for model in self.loaded() if model.idle() and not model.unloading]
        return min(idle, key=lambda model: model.last_used, default=None)

    def _start_unload(self, model: ServedModel) -> None:
        """Unload `model` if it is still idle past its keep_alive (a timer's call)."""
        model.expire_at(None)
        if model.idle() and model.llm is not None:
            task = asyncio.create_task(self._unload_if_expired(model))
            task.add_done_callback(_retrieve)

    async def _unload_if_expired(self, model: ServedModel) -> None:
        """Unload `model` if it is idle past its keep_alive; if it is idle but not quite
        (asyncio may run a timer up to its clock's resolution early), look again then."""
        async with self._lock:
            if model.llm is None or not model.idle() or not math.isfinite(model.keep_alive):
                return
            remaining = model.last_used + model.keep_alive - time.monotonic()
            if remaining > 0:
                loop = asyncio.get_running_loop()
                model.expire_at(loop.call_later(remaining, self._start_unload, model))
                return
            await self._unload(model)

    async def _unload_when_idle(self, model: ServedModel) -> float:
        async with self._lock:
            if model.llm is None:
                return 0.0
            model.unloading = True
            try:
                if not model.idle():
                    await model.wait_idle()
                return await self._unload(model)
            finally:
                model.unloading = False

    async def _unload(self, model: ServedModel) -> float:
        """Stop `model`'s engine and give its memory back (under `_lock`, model idle)."""
        started = time.monotonic()
        llm = model.drop_engine()
        assert llm is not None
        await llm.shutdown()
        del llm
        gc.collect()
        trim_heap()
        seconds = time.monotonic() - started
        logger.info("model '%s' unloaded in %.2f s", model.name, seconds)
        return seconds

    async def _watch(self, model: ServedModel, llm: AsyncLLM | AsyncPooler) -> None:
        """Wait for the engine's loop to end; if it died, say so. A single model's server
        hears of it (`on_engine_death`); of several, the model unloads, to load again."""
        failure = await llm.wait_ended()
        if failure is None:
            return
        logger.error(
            "the engine died (%s: %s): the requests in flight of '%s' were failed with an error",
            type(failure).__name__,
            failure,
            model.name,
        )
        if self.single:
            if self.on_engine_death is not None:
                self.on_engine_death(failure)
            return
        if model.llm is llm:
            model.drop_engine(failure)


def _root_name(model: str) -> str:
    """The model's own name (a folder's, a file's); a path that does not exist fails at
    its load, reported there."""
    try:
        return resolve_model_source(model)[1]
    except ModelLoadError:
        return Path(model).stem


def _load_error(model: ServedModel, exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    return OpenAIError(
        503, f"the model '{model.name}' failed to load: {exc}", type="service_unavailable"
    )


def _log_loaded(model: ServedModel, llm: AsyncLLM | AsyncPooler) -> None:
    if isinstance(llm, AsyncPooler):  # no KV cache
        logger.info(
            "model %s served as '%s': a pooling model (%s) in %s on the CPU, max_model_len %d; "
            "loaded in %.2f s",
            llm.model_name, model.name, llm.spec.task, str(llm.dtype).removeprefix("torch."),
            llm.max_model_len, model.load_seconds,
        )  # fmt: skip
        return
    num_blocks = llm.num_kv_blocks
    logger.info(
        "model %s served as '%s': %s on %s, max_model_len %d, %d KV blocks of %d tokens "
        "(%d tokens of KV capacity); loaded in %.2f s",
        llm.model_name,
        model.name,
        str(llm.dtype).removeprefix("torch."),
        llm.device,
        llm.max_model_len,
        num_blocks,
        llm.block_size,
        num_blocks * llm.block_size,
        model.load_seconds,
    )


def _retrieve(task: asyncio.Task[object]) -> None:
    """Mark a background task's exception as seen (its waiters got it, or none waited)."""
    if not task.cancelled():
        task.exception()


class ModelLeases:
    """ASGI middleware: once a response has been sent (a stream's last event included),
    release the models its request held (`LEASES` in its scope)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for release in scope.pop(LEASES, ()):
                release()
