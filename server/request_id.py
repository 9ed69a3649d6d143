"""X-Request-Id on every response: the client's own id when it sent a sane one, else new.

A pure ASGI middleware (not BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched. The id is also put in `request.state.request_id`
for logs and 500 messages; it is for correlation only and never used as an engine
request id, since clients may reuse it.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_LENGTH = 128


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
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, encoded)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _incoming_id(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == HEADER:
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_LENGTH and text.isascii() and text.isprintable():
                return text
    return None
