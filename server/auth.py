"""Bearer-token check for the /v1 API; /health, /metrics and /version stay open.

The server accepts any of its keys (`ServeConfig.api_keys`: `api_key`, a list of them, and
`api_key_file`'s). What a request stores belongs to its key: `key_owner` names the owner
by a digest of the key, so the store never holds a key itself.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from server.errors import OpenAIError
from server.state import server_state


async def require_api_key(request: Request) -> None:
    """Pass when no key is configured, or when `Authorization: Bearer <key>` holds one.

    Every key is compared, each in the same time wherever the tokens differ, so response
    timing reveals neither how much of a guessed key is right nor which key it was near.
    """
    keys = server_state(request).api_keys
    if not keys:
        return
    scheme, token = _bearer(request)
    matches = False
    for key in keys:
        matches |= hmac.compare_digest(token.encode(), key)
    if scheme.lower() != "bearer" or not matches:
        raise OpenAIError(
            401,
            "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def key_owner(request: Request) -> str:
    """The owner of what a request that passed `require_api_key` stores: the SHA-256 of
    its key, or "" on a server without keys (where everything is everyone's)."""
    if not server_state(request).api_keys:
        return ""
    return hashlib.sha256(_bearer(request)[1].encode()).hexdigest()


def _bearer(request: Request) -> tuple[str, str]:
    """The scheme and the token of the Authorization header ("" and "" without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme, token.strip()
