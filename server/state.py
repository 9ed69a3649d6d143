"""What the request handlers of one app share: settings, metrics, the models and their
engines, and the tasks that the app's components run beside it."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from server.admission import Admission, max_queued
from server.config import ServeConfig
from server.metrics import ServerMetrics
from server.model_pool import LLMFactory, ModelPool, ToolCallingFactory

if TYPE_CHECKING:
    from engine.snapshot import EngineStats


@dataclass(slots=True)
class ServerState:
    """The app's settings, metrics, admission, and its models (one
    engine each, loaded and unloaded by `models`, server/model_pool.py)."""

    config: ServeConfig
    llm_factory: LLMFactory = field(kw_only=True, repr=False)
    tool_calling_factory: ToolCallingFactory = field(kw_only=True, repr=False)
    started_at: int = field(default_factory=lambda: int(time.time()))
    models: ModelPool = field(init=False)
    metrics: ServerMetrics = field(init=False)
    admission: Admission = field(init=False)
    # Run by the app's lifespan from start-up to shutdown, cancelled then (a component's own
    # loops, such as the dashboard's history); registered before the app starts.
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    api_keys: tuple[bytes, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.models = ModelPool(self.config, self.llm_factory, self.tool_calling_factory)
        self.metrics = ServerMetrics(self.engine_stats, self.engine_sequences_by_priority)
        self.admission = Admission(
            max_queued(self.config),
            self.config.max_num_seqs,
            self.engine_waiting,
            self.metrics.requests_rejected.inc,
        )
        self.api_keys = tuple(key.encode() for key in self.config.api_keys())

    def engine_stats(self) -> list[tuple[str, EngineStats]]:
        """Each loaded model's name and engine snapshot."""
        return [(name, llm.stats()) for name, llm in self.models.engines()]

    def engine_sequences_by_priority(self) -> list[tuple[str, dict[str, dict[int, int]]]]:
        """Each loaded model's name and unfinished sequences by status and priority."""
        return [(name, llm.sequences_by_priority()) for name, llm in self.models.engines()]

    def engine_waiting(self) -> int:
        """Sequences the engines' schedulers hold waiting (0 while none is loaded)."""
        return sum(llm.stats().num_waiting for _, llm in self.models.engines())


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
