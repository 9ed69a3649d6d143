"""Bearer-token check for the /v1 API; /health, /metrics and /version stay open."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import OpenAIError
from server.state import server_state


async def require_api_key(request: Request) -> None:
    """Pass when no key is configured, or when `Authorization: Bearer <key>` matches it.

    The comparison takes the same time wherever the tokens differ, so response timing
    does not reveal how much of a guessed key is right.
    """
    expected = server_state(request).config.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    matches = hmac.compare_digest(token.strip().encode(), expected.get_secret_value().encode())
    if scheme.lower() != "bearer" or not matches:
        raise OpenAIError(
            401,
            "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
