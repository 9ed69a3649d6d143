"""API-key check for the /v1 API; /health, /metrics and /version stay open.

The server accepts any of its keys (`ServeConfig.api_keys`: `api_key`, a list of them, and
`api_key_file`'s), sent as `Authorization: Bearer <key>` (OpenAI's clients) or as
`x-api-key: <key>` (Anthropic's). What a request stores belongs to its key: `key_owner`
names the owner by a digest of the key, so the store never holds a key itself.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel

from server.errors import OpenAIError
from server.openapi import FAILED, KEYED, ErrorBody, documented
from server.state import server_state


async def require_api_key(request: Request) -> None:
    """Pass when no key is configured, or when the request carries one of them.

    Every key is compared, each in the same time wherever the tokens differ, so response
    timing reveals neither how much of a guessed key is right nor which key it was near.
    """
    keys = server_state(request).api_keys
    if not keys:
        return
    token = _sent_key(request)
    matches = False
    for key in keys:
        matches |= hmac.compare_digest(token.encode(), key)
    if token == "" or not matches:
        raise OpenAIError(
            401,
            "invalid or missing API key: send the header 'Authorization: Bearer <key>' or "
            "'x-api-key: <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def keyed_router(
    envelope: type[BaseModel] = ErrorBody, route_class: type[APIRoute] = APIRoute
) -> APIRouter:
    """A router of operations behind the API key; /openapi.json says each can answer the
    key's 401 and a 500, in `envelope`."""
    return APIRouter(
        route_class=route_class,
        dependencies=[Depends(require_api_key)],
        responses=documented(None, *KEYED, *FAILED, envelope=envelope),
    )


def key_owner(request: Request) -> str:
    """The owner of what a request that passed `require_api_key` stores: the SHA-256 of
    its key, or "" on a server without keys (where everything is everyone's)."""
    if not server_state(request).api_keys:
        return ""
    return hashlib.sha256(_sent_key(request).encode()).hexdigest()


def _sent_key(request: Request) -> str:
    """The key the request sent: a bearer token, else the x-api-key header; "" if none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip()
