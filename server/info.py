"""Endpoints about the server itself: health, metrics, version, and the model list."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from server.auth import require_api_key
from server.protocol import ModelCard, ModelList
from server.state import server_state

try:
    VERSION = version("pagedserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "unknown"

open_router = APIRouter()
api_router = APIRouter(dependencies=[Depends(require_api_key)])


@open_router.get("/health")
async def health(request: Request) -> Response:
    """200 once the engine is loaded and its loop alive; 503 before, and after it died."""
    state = server_state(request)
    if state.llm is None:
        status = "loading" if state.load_error is None else "failed"
    else:
        status = "ok" if state.llm.is_healthy else "engine stopped"
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@open_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@open_router.get("/version")
async def server_version() -> dict[str, str]:
    return {"version": VERSION}


@api_router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = server_state(request)
    llm = state.ready_llm()
    card = ModelCard(
        id=state.model_name,
        created=state.started_at,
        root=llm.model_name,
        max_model_len=llm.max_model_len,
        default_sampling_params=llm.default_sampling,
    )
    return ModelList(data=[card])
