"""API-key check for the /v1 API; /health, /metrics and /version stay open."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import OpenAIError
from server.state import server_state


async def require_api_key(request: Request) -> None:
    """Pass when no key is configured, or when the request carries it: as
    `Authorization: Bearer <key>` (OpenAI's clients) or as `x-api-key: <key>` (Anthropic's).

    The comparison takes the same time wherever the tokens differ, so response timing
    does not reveal how much of a guessed key is right.
    """
    expected = server_state(request).config.api_key
    if expected is None:
        return
    key = expected.get_secret_value().encode()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)
    header = request.headers.get("x-api-key")
    if bearer or (header is not None and hmac.compare_digest(header.strip().encode(), key)):
        return
    raise OpenAIError(
        401,
        "invalid or missing API key: send the header 'Authorization: Bearer <key>' or "
        "'x-api-key: <key>'",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
