"""Sleep endpoints, as vLLM names them: `POST /sleep?level=1|2`, `POST /wake_up`,
`GET /is_sleeping` (engine/sleep.py says what each level gives back).

`/sleep` answers once the engine sleeps: after the requests in flight have finished. A
request that arrives while it sleeps wakes it (and so does `/wake_up`); /health does not.
In a server of several models, each call applies to every loaded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Query, Request
from pydantic import Field

from server.auth import keyed_router
from server.errors import OpenAIError
from server.openapi import INVALID, documented
from server.protocol import ResponseModel
from server.state import server_state

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM

router = keyed_router()


class SleepReport(ResponseModel):
    is_sleeping: bool
    level: int
    released_bytes: int = Field(description="the memory the sleep gave back")
    seconds: float


class SleepState(ResponseModel):
    is_sleeping: bool


def _refuse_unknown(request: Request, known: frozenset[str]) -> None:
    for name in request.query_params:
        if name not in known:
            raise OpenAIError(400, f"'{name}' is not a parameter of {request.url.path}", param=name)


def _engines(request: Request) -> list[AsyncLLM]:
    """A single model's engine (a 503 while it loads); else every loaded model's."""
    models = server_state(request).models
    if models.single:
        return [models.first.ready_llm()]
    return [llm for _, llm in models.engines()]


Level = Annotated[
    int, Query(ge=1, le=2, description="1: the KV cache's memory; 2: the weights' too")
]


@router.post("/sleep", responses=documented(SleepReport, *INVALID, 503))
async def sleep(request: Request, level: Level = 1) -> SleepReport:
    _refuse_unknown(request, frozenset({"level"}))
    engines = _engines(request)
    for llm in engines:
        if llm.sleep_unsupported is not None:
            raise OpenAIError(400, llm.sleep_unsupported)
    reports = [await llm.sleep(level) for llm in engines]
    return SleepReport(
        is_sleeping=_sleeping(engines),
        level=level,
        released_bytes=sum(report.released_bytes for report in reports),
        seconds=round(sum(report.seconds for report in reports), 6),
    )


def _sleeping(engines: list[AsyncLLM]) -> bool:
    return bool(engines) and all(llm.sleep_level > 0 for llm in engines)


@router.post("/wake_up", responses=documented(SleepState, *INVALID, 503))
async def wake_up(request: Request) -> SleepState:
    if "tags" in request.query_params:
        raise OpenAIError(
            400, "tags: waking a part of the model is not supported; /wake_up wakes it whole",
            param="tags",
        )  # fmt: skip
    _refuse_unknown(request, frozenset())
    engines = _engines(request)
    for llm in engines:
        await llm.wake_up()
    return SleepState(is_sleeping=_sleeping(engines))


@router.get("/is_sleeping", responses=documented(SleepState, 503))
async def is_sleeping(request: Request) -> SleepState:
    return SleepState(is_sleeping=_sleeping(_engines(request)))
