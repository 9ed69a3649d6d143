"""The live dashboard: a page at /dashboard and the JSON it polls at /dashboard/state.

The page and its script (server/dashboard/static/) are open: they hold no data and no secret, and
refer to nothing outside this server (their Content-Security-Policy forbids it). The data
endpoint requires the API key like /v1; the page sends it as a bearer token. It shows the
server's first configured model (a single model's server: its model).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from engine.errors import EngineError
from engine.snapshot import BlockState, EngineStats, SequenceSnapshot
from server.auth import keyed_router
from server.dashboard.history import Sample, StatsHistory
from server.errors import OpenAIError
from server.openapi import documented
from server.state import ServerState, server_state

STATIC = Path(__file__).parent / "static"
# Same-origin scripts and fetches only; the page's styles are inline.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
    "style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}

page_router = APIRouter(include_in_schema=False)
data_router = keyed_router()


def install(app: FastAPI) -> None:
    """Serve the page and its script (open) and the data (behind the API key) from `app`,
    and record the history while the app runs (a task of the server state's `background`)."""
    state: ServerState = app.state.server
    model = state.models.first

    def stats() -> EngineStats | None:
        return None if model.llm is None else model.llm.stats()

    history = StatsHistory(stats, functools.partial(state.metrics.first_tokens, model.name))
    state.background.append(history.run)
    app.state.dashboard_history = history
    app.include_router(page_router)
    app.include_router(data_router)


class BlockMap(BaseModel):
    block_size: int = Field(description="tokens a block holds")
    states: str = Field(description="one character per KV block, by block id; see `legend`")
    legend: dict[str, str] = Field(description="character -> state name")
    counts: dict[str, int] = Field(description="state name -> blocks; sums to len(states)")


class History(BaseModel):
    interval: float = Field(description="seconds between samples")
    window: float = Field(description="seconds of samples kept")
    samples: list[Sample] = Field(description="oldest first")


class DashboardState(BaseModel):
    """The engine between two steps (blocks, sequences, totals agree), plus the history."""

    time: float = Field(description="Unix time of the snapshot")
    model: str
    scheduling_policy: str = Field(
        description="fcfs or priority: the order of the waiting sequences"
    )
    blocks: BlockMap
    sequences: list[SequenceSnapshot] = Field(
        description="running ones in admission order, then waiting ones in queue order "
        "(by priority, then arrival, under the priority policy)"
    )
    totals: EngineStats = Field(description="counters since start and current levels")
    prefix_cache_hit_rate: float | None = Field(
        description="prompt tokens served from the prefix cache over those looked up, since "
        "start; null before any lookup"
    )
    acceptance_length: float | None = Field(
        description="speculative decoding: tokens per verification (1 + accepted draft "
        "tokens / drafts), since start; null while it is off or before a draft"
    )
    history: History


@page_router.get("/dashboard")
async def dashboard_page() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", headers=_HEADERS)


@page_router.get("/dashboard/dashboard.js")
async def dashboard_script() -> FileResponse:
    return FileResponse(STATIC / "dashboard.js", headers=_HEADERS)


@data_router.get("/dashboard/state", responses=documented(None, 400, 503))
async def dashboard_state(request: Request) -> DashboardState:
    """One snapshot taken on the engine thread between two steps (`AsyncLLM.snapshot`);
    503 while the model loads or once the engine has stopped."""
    state = server_state(request)
    history: StatsHistory = request.app.state.dashboard_history
    model = state.models.first
    llm = model.generator("the dashboard")
    try:
        snapshot = await llm.snapshot()
    except EngineError as exc:
        raise OpenAIError(503, "the engine has stopped", type="service_unavailable") from exc
    stats = snapshot.stats
    counts = snapshot.block_counts()
    queries = stats.prefix_cache_queries
    return DashboardState(
        time=time.time(),
        model=model.name,
        scheduling_policy=snapshot.scheduling_policy,
        blocks=BlockMap(
            block_size=llm.block_size,
            states=snapshot.block_map,
            legend={block_state.value: block_state.name.lower() for block_state in BlockState},
            counts={block_state.name.lower(): n for block_state, n in counts.items()},
        ),
        sequences=list(snapshot.sequences),
        totals=stats,
        prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else None,
        acceptance_length=_acceptance_length(stats),
        history=History(
            interval=history.interval, window=history.window, samples=history.samples()
        ),
    )


def _acceptance_length(stats: EngineStats) -> float | None:
    speculation = stats.speculation
    if speculation is None or not speculation.num_drafts:
        return None
    return 1 + speculation.num_accepted_tokens / speculation.num_drafts
