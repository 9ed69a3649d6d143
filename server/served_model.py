"""One model a server serves: its name, its engine's settings, its engine once loaded,
its users and its keep_alive timer (the pool of them: server/model_pool.py).

Invariants: `users` counts the requests holding it, and its idle event is set exactly
when none does; at most one keep_alive timer is pending; the tool calling derived from an
engine is forgotten with the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from engine.async_llm import AsyncLLM
from engine.pooling.async_pooler import AsyncPooler
from server.errors import OpenAIError
from server.reasoning import ReasoningSyntax

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request.intake import SpecialTokens
    from server.conversation import ToolCalling

# The tools component's entry point with the `tool_call_parser` setting given: a chat template and
# special tokens in; None where the component is missing.
ModelToolCalling = Callable[["str | None", "SpecialTokens"], "ToolCalling | None"]


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"
    FAILED = "failed"


@dataclass(eq=False)
class ServedModel:
    """One configured model: its name, its engine's settings, and its engine once loaded.
    `root` is the model's own name (a folder's or file's), which a single model also
    answers to."""

    name: str
    root: str
    config: EngineConfig
    keep_alive: float
    tool_calling_factory: ModelToolCalling = field(repr=False)
    # Its engine once loaded: a pooling model's serves the pooling endpoints only.
    llm: AsyncLLM | AsyncPooler | None = None
    load_error: BaseException | None = None
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    loading: asyncio.Task[None] | None = field(default=None, repr=False)
    unloading: bool = False
    load_seconds: float = 0.0
    # Its LoRA adapters, name -> folder: `lora_modules` and those loaded at run time; an
    # engine loads with all of them.
    adapters: dict[str, str] = field(default_factory=dict)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _expiry: asyncio.TimerHandle | None = field(default=None, repr=False)
    _tool_calling: tuple[ToolCalling | None] | None = field(default=None, repr=False)

    @property
    def state(self) -> ModelState:
        if self.loading is not None:
            return ModelState.LOADING
        if self.llm is None:
            return ModelState.UNLOADED if self.load_error is None else ModelState.FAILED
        return ModelState.SLEEPING if self.llm.sleep_level > 0 else ModelState.LOADED

    def ready_llm(self) -> AsyncLLM | AsyncPooler:
        """The engine, or a 503 while it loads, after it failed to load, or once it died."""
        if self.llm is None:
            reason = "is still loading" if self.load_error is None else "failed to load"
            raise OpenAIError(503, f"the model {reason}", type="service_unavailable")
        if not self.llm.is_healthy:
            raise OpenAIError(503, "the engine has stopped", type="service_unavailable")
        return self.llm

    def generator(self, use: str) -> AsyncLLM:
        """The engine of a model that generates; a 400 naming `use` (an endpoint, a
        feature) for a pooling model."""
        llm = self.ready_llm()
        if isinstance(llm, AsyncPooler):
            serves = "/score and /rerank"
            if llm.spec.task == "embed":
                serves = "/v1/embeddings, /score and /rerank"
            raise OpenAIError(
                400, f"the model '{self.name}' is a pooling model: it serves {serves}, not {use}",
                param="model",
            )  # fmt: skip
        return llm

    def pooler(self, use: str) -> AsyncPooler:
        """The engine of a pooling model; a 400 naming `use` (an endpoint) for a model that
        generates."""
        llm = self.ready_llm()
        if not isinstance(llm, AsyncPooler):
            raise OpenAIError(
                400, f"the model '{self.name}' generates text: {use} needs a pooling model (an "
                "embedding model, a cross-encoder or a reranker)", param="model",
            )  # fmt: skip
        return llm

    def tool_calling(self) -> ToolCalling | None:
        """How the model writes tool calls (the `tool_call_parser` setting), from the tools
        component, asked the first time a request needs it; None without it."""
        llm = self.generator("tools")
        if self._tool_calling is None:
            calling = self.tool_calling_factory(llm.chat_template, llm.special_tokens)
            self._tool_calling = (calling,)
        return self._tool_calling[0]

    def reasoning_syntax(self, parser: str) -> ReasoningSyntax | None:
        """How the model reasons under the `reasoning_parser` setting; None: it does not."""
        llm = self.generator("reasoning")
        return ReasoningSyntax.of(parser, llm.chat_template, llm.special_tokens.text)

    def hold(self) -> None:
        self.users += 1
        self._idle.clear()
        self.expire_at(None)

    def idle(self) -> bool:
        return self.users == 0

    def release(self) -> bool:
        """One user is done; True when it was the last."""
        self.users -= 1
        self.last_used = time.monotonic()
        if self.users:
            return False
        self._idle.set()
        return True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def expire_at(self, expiry: asyncio.TimerHandle | None) -> None:
        """Replace the timer of its keep_alive (None: none runs)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = expiry

    def drop_engine(self, failure: BaseException | None = None) -> AsyncLLM | AsyncPooler | None:
        """Forget the engine (what the model derived from it too); `failure`: why, if it
        died. Returns the engine, for the caller to shut down."""
        llm, self.llm, self._tool_calling = self.llm, None, None
        if failure is not None:
            self.load_error = failure
        return llm
