"""One HTTP request carried whole from the ingress to an engine replica, and run there
through the replica's ASGI app as if a client had sent it.

The ingress reads the body before it forwards anything, so a forwarded request is a plain
value (method, path, headers, body) that Ray pickles to the replica, plus the prompt the
ingress rendered from it: its token ids, which the replica's app takes instead of
rendering and tokenizing the prompt again, and its block hashes, which the router routes
by and the replica's prefix cache starts from. The replica answers with the app's ASGI
messages, one at a time, so a server-sent-events stream stays a stream through the
ingress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Scope

from engine.request.intake import RenderedPrompt
from server.generation import RENDERED_PROMPT

logger = logging.getLogger(__name__)

# How long an app may take to wind down after its client went away (it aborts its engine
# requests at once; this only bounds a handler that ignores the disconnect).
DISCONNECT_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it.

    `headers` are ASGI's raw (lower-case name, value) byte pairs; `body` is the whole
    body. `prompt` is the prompt the request will run, rendered and hashed by the ingress
    with the replica's tokenizer (for a completion of several prompts, the first one's),
    None when it runs none or could not be rendered (the replica then reports why).
    """

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    prompt: RenderedPrompt | None = field(default=None, repr=False)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """The chained KV-cache block hashes of the prompt, empty without one."""
        return () if self.prompt is None else self.prompt.block_hashes

    def scope(self) -> Scope:
        """The ASGI HTTP scope of this request. Spec 2.3: a streaming response learns of a
        disconnect from `receive`, at once, rather than at its next send."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query_string,
            "root_path": "",
            "headers": list(self.headers),
            "client": self.client,
            "server": None,
            "state": {} if self.prompt is None else {RENDERED_PROMPT: self.prompt},
        }


async def call_app(
    app: ASGIApp, request: ForwardedRequest, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> AsyncGenerator[Message, None]:
    """Run `app` on `request`; yield its response messages (`http.response.start` with
    `extra_headers` added, then the `http.response.body` parts) up to the last body part.

    Closing the generator early (the ingress's client went away, or the call was
    cancelled) is the client's disconnect: the app's `receive` returns `http.disconnect`,
    which makes pagedserve abort the request's engine requests and free their KV blocks,
    and the generator waits for the app to finish (cancelling it after
    DISCONNECT_GRACE_S). An app that fails after its response has started is logged.
    """
    outbox: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the client disconnected")
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra_headers]}
        outbox.put_nowait(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        except Exception:
            if not gone.is_set():
                logger.exception("the app failed on %s %s", request.method, request.path)
        finally:
            outbox.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await outbox.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        if not task.done():
            gone.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(task, DISCONNECT_GRACE_S)
