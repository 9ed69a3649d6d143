"""Sleep endpoints, as vLLM names them: `POST /sleep?level=1|2`, `POST /wake_up`,
`GET /is_sleeping` (engine/sleep.py says what each level gives back).

`/sleep` answers once the engine sleeps: after the requests in flight have finished. A
request that arrives while it sleeps wakes it (and so does `/wake_up`); /health does not.
In a server of several models, each call applies to every loaded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request

from server.auth import require_api_key
from server.errors import OpenAIError
from server.state import server_state

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM

router = APIRouter(dependencies=[Depends(require_api_key)])


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


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, object]:
    _refuse_unknown(request, frozenset({"level"}))
    engines = _engines(request)
    for llm in engines:
        if llm.sleep_unsupported is not None:
            raise OpenAIError(400, llm.sleep_unsupported)
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise OpenAIError(400, f"level must be 1 or 2, not '{level}'", param="level")
    reports = [await llm.sleep(int(level)) for llm in engines]
    return {
        "is_sleeping": _sleeping(engines),
        "level": int(level),
        "released_bytes": sum(report.released_bytes for report in reports),
        "seconds": round(sum(report.seconds for report in reports), 6),
    }


def _sleeping(engines: list[AsyncLLM]) -> bool:
    return bool(engines) and all(llm.sleep_level > 0 for llm in engines)


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, bool]:
    if "tags" in request.query_params:
        raise OpenAIError(
            400, "tags: waking a part of the model is not supported; /wake_up wakes it whole",
            param="tags",
        )  # fmt: skip
    _refuse_unknown(request, frozenset())
    engines = _engines(request)
    for llm in engines:
        await llm.wake_up()
    return {"is_sleeping": _sleeping(engines)}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": _sleeping(_engines(request))}
