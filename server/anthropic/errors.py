"""Every error of the Anthropic endpoints leaves as Anthropic's envelope:
`{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}`.

The server's errors are raised as `OpenAIError`s (one vocabulary inside); a route of
`AnthropicRoute` turns each into Anthropic's envelope, with the same status and headers
and Anthropic's name for its kind. The messages are the server's own: a 400 names the
field (`messages[0].content[1].tool_use_id: ...`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from engine.errors import EngineError
from server.anthropic.protocol import BLOCK_TYPES, REFUSED_FIELDS
from server.errors import (
    ClientDisconnected,
    OpenAIError,
    describe_validation_error,
    engine_failure,
    http_error,
    request_id,
)

logger = logging.getLogger(__name__)

# Anthropic's error types by HTTP status; any other 4xx is an invalid request, 5xx an
# api_error.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, not_found_error, api_error, ...")
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error envelope, as `error_body` writes it."""

    type: Literal["error"]
    error: AnthropicErrorDetail
    request_id: str


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: OpenAIError, http_id: str) -> dict[str, Any]:
    """Anthropic's envelope of `error` (also an `error` event's data, in a stream), as
    /openapi.json declares it."""
    detail = AnthropicErrorDetail(type=error_type(error.status), message=error.message)
    return AnthropicErrorBody(type="error", error=detail, request_id=http_id).model_dump()


def error_response(error: OpenAIError, http_id: str) -> JSONResponse:
    return JSONResponse(error_body(error, http_id), status_code=error.status, headers=error.headers)


def describe(exc: RequestValidationError) -> OpenAIError:
    """The 400 of an invalid body, as `server.errors` describes it for OpenAI's
    endpoints, its location without pydantic's tags of the content block types."""
    errors = [{**error, "loc": _untagged(error["loc"])} for error in exc.errors()]
    return describe_validation_error(RequestValidationError(errors), REFUSED_FIELDS)


def _untagged(location: tuple[int | str, ...]) -> tuple[int | str, ...]:
    # A discriminated union names the member it tried after the list index (`content, 0,
    # 'text', 'text'`); the client's path has no such step.
    return tuple(
        part
        for i, part in enumerate(location)
        if not (part in BLOCK_TYPES and i > 0 and isinstance(location[i - 1], int))
    )


class AnthropicRoute(APIRoute):
    """A route whose errors, its body's validation and its dependencies' (the API key)
    included, are Anthropic's envelope."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return error_response(describe(exc), request_id(request))
            except OpenAIError as exc:
                return error_response(exc, request_id(request))
            except HTTPException as exc:  # FastAPI's: a body it cannot read as JSON
                return error_response(http_error(exc), request_id(request))
            except EngineError as exc:
                http_id = request_id(request)
                return error_response(engine_failure(http_id, exc), http_id)
            except ClientDisconnected:
                raise
            except Exception:
                http_id = request_id(request)
                logger.exception("request %s failed", http_id)
                error = OpenAIError(500, f"internal server error (request id {http_id})")
                return error_response(error, http_id)

        return handle
