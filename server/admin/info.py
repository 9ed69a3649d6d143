"""Endpoints about the server itself: health, metrics and version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import Field

from server.openapi import FAILED, documented
from server.protocol import ResponseModel
from server.state import server_state

try:
    VERSION = version("pagedserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "unknown"

open_router = APIRouter(responses=documented(None, *FAILED))


class Health(ResponseModel):
    status: str = Field(description="ok; else loading, failed, unloaded or engine stopped")


@open_router.get("/health", response_model=None, responses=documented(Health, 503, envelope=Health))
async def health(request: Request) -> Response:
    """A single model's server: 200 once its engine is loaded and its loop alive, 503
    before and after it died. A server of several models: 200 while it runs (each
    model's state is in /v1/models)."""
    models = server_state(request).models
    model = models.first
    if not models.single:
        status = "ok"
    elif model.llm is None:
        # Unloaded after its keep_alive, it loads again on the next request.
        status = {"failed": "failed", "unloaded": "ok" if models.autoload else "unloaded"}.get(
            model.state, "loading"
        )
    else:
        status = "ok" if model.llm.is_healthy else "engine stopped"
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@open_router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses=documented(None, media_type="text/plain"),
)
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@open_router.get("/version")
async def server_version() -> dict[str, str]:
    return {"version": VERSION}
