"""What the request handlers of one app share: settings, metrics, the engine, and the
tasks that the app's rooms run beside it."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from server.admission import Admission, max_queued
from server.config import ServeConfig
from server.errors import OpenAIError
from server.metrics import ServerMetrics
from server.reasoning import ReasoningSyntax
from server.response_store import ResponseStore

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.request.intake import SpecialTokens
    from engine.snapshot import EngineStats
    from server.conversation import ToolCalling

# The tools room's door (`server.capabilities.tool_calling`): the `tool_call_parser`
# setting, the chat template and the special tokens in; None where the room is missing.
ToolRoom = Callable[[str, "str | None", "SpecialTokens"], "ToolCalling | None"]


@dataclass(slots=True)
class ServerState:
    """Invariant: while the engine loads, `llm` and `load_error` are both None; afterwards
    exactly one of them is set, and it never changes again. `tool_room` is called at most
    once, by the first request that needs tool calling."""

    config: ServeConfig
    tool_room: ToolRoom = field(kw_only=True, repr=False)
    llm: AsyncLLM | None = None
    load_error: BaseException | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)
    admission: Admission = field(init=False)
    # Run by the app's lifespan from start-up to shutdown, cancelled then (a room's own
    # loops, such as the dashboard's history); registered before the app starts.
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    api_keys: tuple[bytes, ...] = field(init=False, repr=False)
    responses: ResponseStore = field(init=False)
    _tool_calling: ToolCalling | None = field(default=None, init=False, repr=False)
    _tool_room_asked: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(
            self.engine_stats, self.loaded_model_name, self.engine_sequences_by_priority
        )
        self.admission = Admission(
            max_queued(self.config),
            self.config.max_num_seqs,
            self.engine_waiting,
            self.metrics.requests_rejected.inc,
        )
        self.api_keys = tuple(key.encode() for key in self.config.api_keys())
        self.responses = ResponseStore(self.config.response_store_path())

    def engine_stats(self) -> EngineStats | None:
        return None if self.llm is None else self.llm.stats()

    def engine_sequences_by_priority(self) -> dict[str, dict[int, int]] | None:
        return None if self.llm is None else self.llm.sequences_by_priority()

    def engine_waiting(self) -> int:
        """Sequences the engine's scheduler holds waiting (0 while it loads)."""
        return 0 if self.llm is None else self.llm.stats().num_waiting

    def loaded_model_name(self) -> str | None:
        """`model_name` once the engine is loaded, else None."""
        return None if self.llm is None else self.model_name

    def ready_llm(self) -> AsyncLLM:
        """The engine, or a 503 while it loads, after it failed to load, or once it died."""
        if self.llm is None:
            reason = "is still loading" if self.load_error is None else "failed to load"
            raise OpenAIError(503, f"the model {reason}", type="service_unavailable")
        if not self.llm.is_healthy:
            raise OpenAIError(503, "the engine has stopped", type="service_unavailable")
        return self.llm

    def tool_calling(self) -> ToolCalling | None:
        """How the served model writes tool calls (the `tool_call_parser` setting), from
        the tools room, imported the first time a request needs it; None without it."""
        assert self.llm is not None
        if not self._tool_room_asked:
            self._tool_room_asked = True
            self._tool_calling = self.tool_room(
                self.config.tool_call_parser, self.llm.chat_template, self.llm.special_tokens
            )
        return self._tool_calling

    def reasoning_syntax(self) -> ReasoningSyntax | None:
        """How the served model reasons (the `reasoning_parser` setting); None: it does not."""
        assert self.llm is not None
        return ReasoningSyntax.of(
            self.config.reasoning_parser, self.llm.chat_template, self.llm.special_tokens.text
        )

    @property
    def model_name(self) -> str:
        """The name clients see; only meaningful once the engine is loaded."""
        assert self.llm is not None
        return self.config.served_model_name or self.llm.model_name

    def check_model(self, name: str) -> None:
        """404 unless `name` is the served name or the engine's own model name."""
        assert self.llm is not None
        if name not in (self.model_name, self.llm.model_name):
            raise OpenAIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
