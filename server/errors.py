"""Every error leaves the server as OpenAI's body: `{"error": {message, type, param, code}}`.

User errors are 4xx and name the offending parameter where there is one; engine failures
and bugs are 500s that carry the request id so a user report can be matched to the log.

That id is the X-Request-Id every response carries (`RequestIdMiddleware`): the client's
own id when it sent a sane one, else a new one. The middleware is pure ASGI (not
BaseHTTPMiddleware), so streaming responses and client disconnects pass through untouched.
It puts the id in `request.state.request_id` for logs and 500 messages; it is for
correlation only and never used as an engine request id, since clients may reuse it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import EngineError
from server.openapi import ErrorBody, ErrorDetail
from server.protocol import FIELD_ERROR, UNSUPPORTED_FIELDS, undeclared_field_reason

logger = logging.getLogger(__name__)

# nginx's "client closed request": the status of a response nobody will read.
CLIENT_CLOSED_REQUEST = 499
# Pydantic names the member of a union that failed (`prompt.list[int]`); a client
# wants the field's path, so these tags are left out of `param`.
_UNION_TAGS = {"str", "int", "float", "bool"}


class OpenAIError(Exception):
    """An error with the HTTP status and the fields of OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its request was aborted."""


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@contextmanager
def user_errors(fields: set[str], aliases: dict[str, str] | None = None) -> Iterator[None]:
    """Turn a ValueError about the request (from SamplingParams or the intake) into a 400.

    Both raise messages that start with the parameter's name; it becomes `param` when it
    is one of the request's `fields`, after renaming by `aliases` (SamplingParams' name ->
    the request's name for the same setting), which renames it in the message too.
    """
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        name = message.split(" ", 1)[0].rstrip(":,")
        alias = (aliases or {}).get(name)
        if alias is not None:
            message = alias + message.removeprefix(name)
            name = alias
        raise invalid_request(message, name if name in fields else None) from exc


def error_body(error: OpenAIError) -> dict[str, Any]:
    """OpenAI's envelope of `error`, as /openapi.json declares it (`ErrorBody`)."""
    detail = ErrorDetail(message=error.message, type=error.type, param=error.param, code=error.code)
    return ErrorBody(error=detail).model_dump()


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI, item_tags: Collection[str] = ()) -> None:
    """Answer every error in OpenAI's error format. `item_tags`: the tags of the request
    models' discriminated unions of list items, which a field's path leaves out (the
    Responses API's `input[0].message.role` is `input[0].role` to a client)."""

    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(describe_validation_error(exc, item_tags=item_tags))

    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.add_exception_handler(Exception, _unexpected_error)


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "unknown")


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return error_response(exc)


def describe_validation_error(
    exc: RequestValidationError,
    refused: Mapping[str, str] = UNSUPPORTED_FIELDS,
    item_tags: Collection[str] = (),
) -> OpenAIError:
    """A 400 naming an invalid field (`messages[0].content`), or the body itself.

    Of several errors the deepest is the most telling: for a union-typed field it comes
    from the member the value came closest to matching. A model validator's `field_error`
    names the field it is about; an undeclared field says why it is refused (`refused`:
    the API's known fields that are not implemented, with the reasons; `item_tags`: as
    `install_error_handlers` says).
    """
    error = max(exc.errors(), key=lambda candidate: len(candidate["loc"]))
    loc = error["loc"]
    location = [
        part
        for i, part in enumerate(loc)
        if part not in _UNION_TAGS
        and "[" not in str(part)
        and not (part in item_tags and i > 0 and isinstance(loc[i - 1], int))
    ]
    if location and location[0] in ("body", "query", "path"):
        location = location[1:]
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return invalid_request(f"the request body is not valid JSON: {reason}")
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == FIELD_ERROR:
        # A model validator's error about one of its fields, or about the whole body.
        location += error["ctx"]["field"]
        if not location:
            return invalid_request(f"the request body {message}")
    elif error["type"] == "extra_forbidden":
        message = undeclared_field_reason(str(location[-1]), refused)
    if not location or isinstance(location[0], int):
        # FastAPI hands a non-JSON body (or a JSON array) to the model as the body itself.
        return invalid_request("the request body must be a JSON object")
    param = _format_location(location)
    return invalid_request(f"{param}: {message}", param)


def _format_location(location: list[int | str]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return error_response(http_error(exc))


def http_error(exc: StarletteHTTPException) -> OpenAIError:
    """The error of an HTTPException from Starlette or FastAPI (a body that cannot be
    read as JSON, an unknown path), with its status and message."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    message = detail or HTTPStatus(exc.status_code).phrase
    return OpenAIError(exc.status_code, message, type=kind, headers=exc.headers)


async def _engine_error(request: Request, exc: EngineError) -> Response:
    return error_response(engine_failure(request_id(request), exc))


def engine_failure(request_id: str, exc: EngineError) -> OpenAIError:
    """The 500 for a request the engine failed, logged under the client's request id."""
    logger.error("request %s failed in the engine: %s", request_id, exc)
    message = f"the engine failed this request (request id {request_id}): {exc}"
    return OpenAIError(500, message, type="server_error")


def deadline_exceeded(timeout: float, generated: int) -> OpenAIError:
    """The 504 for a request whose deadline passed and whose engine requests were aborted:
    code `queue_timeout` if it had generated nothing yet (it waited for a running slot, or
    was still reading its prompt), else `request_timeout`, with the tokens it had made."""
    if generated == 0:
        message = (
            f"the request's deadline of {timeout:g} s passed before it generated anything "
            "(it waited for the engine); it was cancelled"
        )
        code = "queue_timeout"
    else:
        message = (
            f"the request's deadline of {timeout:g} s passed while it was generating; it was "
            f"stopped after {generated} tokens"
        )
        code = "request_timeout"
    return OpenAIError(504, message, type="timeout_error", code=code)


async def _client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this response, so the traceback still reaches the log.
    # This handler runs outside the middleware stack, hence the explicit request id header.
    rid = request_id(request)
    message = f"internal server error (request id {rid})"
    headers = {"X-Request-Id": rid}
    return error_response(OpenAIError(500, message, type="server_error", headers=headers))


REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_MAX_LENGTH = 128


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        encoded = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER
                ]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, encoded)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _incoming_id(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if 0 < len(text) <= REQUEST_ID_MAX_LENGTH and text.isascii() and text.isprintable():
                return text
    return None
