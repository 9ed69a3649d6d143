"""What /openapi.json says each operation answers, declared beside the code that answers.

A route states its success body and the statuses its handler can raise, by the groups
below (each says which code raises it); its router adds those of its dependencies (the
API key) and the 500 every operation can answer. `documented` turns them into FastAPI's
`responses=`, every error status with the model of its envelope: OpenAI's
(`server/errors.py`) or Anthropic's (`server/anthropic/errors.py`). An invalid body is a
400 (`server/errors.py`), never FastAPI's 422, which `install_openapi` leaves out.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, server_error, ...")
    param: str | None = Field(description="the request's field at fault, as a path")
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error envelope, which every endpoint but Anthropic's answers."""

    error: ErrorDetail


# The statuses a route's code raises.
KEYED = (401,)  # `require_api_key`, on a server with API keys
INVALID = (400,)  # the request's body or parameters, as the handler checks them
# `ModelPool.lease` and `find`: a model of the wrong kind (400), a name the server does not
# serve (404), a model not loaded, loading, failed or without room (503), a load that
# outlasted the request's deadline (504).
MODEL = (400, 404, 503, 504)
ADMITTED = (429, 504)  # `Admission.admit`'s full queue; the request's deadline
FAILED = (500,)  # an engine failure or a bug: any operation

# One server-sent event, as OpenAPI 3.2's `itemSchema` of a text/event-stream describes it.
_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}


def documented(
    ok: type[BaseModel] | None,
    *errors: int,
    stream: str | None = None,
    media_type: str | None = None,
    envelope: type[BaseModel] = ErrorBody,
) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` of an operation: its 200 body (`ok`'s JSON, or `media_type`'s
    text), also server-sent events when it streams (`stream` says what their data is), and
    each of the `errors` in `envelope`."""
    responses: dict[int | str, dict[str, Any]] = {}
    if ok is not None or media_type is not None or stream is not None:
        content: dict[str, Any] = {}
        if media_type is not None:
            content[media_type] = {"schema": {"type": "string"}}
        if stream is not None:
            content["text/event-stream"] = {"itemSchema": {**_EVENT, "description": stream}}
        success: dict[str, Any] = {"description": "Successful Response", "content": content}
        if ok is not None:
            success["model"] = ok
        responses[200] = success
    for status in sorted(set(errors)):
        responses[status] = {"model": envelope, "description": HTTPStatus(status).phrase}
    return responses


def install_openapi(app: FastAPI) -> None:
    """Make `app`'s /openapi.json from its routes, without the 422 FastAPI declares on
    every operation with parameters (the server answers 400 instead), with every error
    a JSON body, as the error handlers write it, where FastAPI would give it the media
    type of the operation's success (a text/plain one's), and with whole bounds written
    as integers (FastAPI writes `1.0`, which a client or fuzzer then sends for an
    integer that the server, strict, refuses)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            for operations in schema["paths"].values():
                for operation in operations.values():
                    _json_errors(operation["responses"])
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            _whole_bounds(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _json_errors(responses: dict[str, Any]) -> None:
    """Drop FastAPI's 422 and give each error its JSON body, in place."""
    responses.pop("422", None)
    for status, response in responses.items():
        if int(status) >= 400 and "content" in response:
            [body] = response["content"].values()
            response["content"] = {"application/json": body}


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _whole_bounds(node: Any) -> None:
    """Write each whole-number bound under `node` as an int, in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                _whole_bounds(value)
    elif isinstance(node, list):
        for item in node:
            _whole_bounds(item)
