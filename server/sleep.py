"""Sleep endpoints, as vLLM names them: `POST /sleep?level=1|2`, `POST /wake_up`,
`GET /is_sleeping` (engine/sleep.py says what each level gives back).

`/sleep` answers once the engine sleeps: after the requests in flight have finished. A
request that arrives while it sleeps wakes it (and so does `/wake_up`); /health does not.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.auth import require_api_key
from server.errors import OpenAIError
from server.state import server_state

router = APIRouter(dependencies=[Depends(require_api_key)])


def _refuse_unknown(request: Request, known: frozenset[str]) -> None:
    for name in request.query_params:
        if name not in known:
            raise OpenAIError(400, f"'{name}' is not a parameter of {request.url.path}", param=name)


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, object]:
    _refuse_unknown(request, frozenset({"level"}))
    llm = server_state(request).ready_llm()
    if llm.sleep_unsupported is not None:
        raise OpenAIError(400, llm.sleep_unsupported)
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise OpenAIError(400, f"level must be 1 or 2, not '{level}'", param="level")
    report = await llm.sleep(int(level))
    return {
        "is_sleeping": llm.sleep_level > 0,
        "level": report.level,
        "released_bytes": report.released_bytes,
        "seconds": round(report.seconds, 6),
    }


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, bool]:
    if "tags" in request.query_params:
        raise OpenAIError(
            400, "tags: waking a part of the model is not supported; /wake_up wakes it whole",
            param="tags",
        )  # fmt: skip
    _refuse_unknown(request, frozenset())
    llm = server_state(request).ready_llm()
    await llm.wake_up()
    return {"is_sleeping": llm.sleep_level > 0}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": server_state(request).ready_llm().sleep_level > 0}
