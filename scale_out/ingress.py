"""The HTTP ingress: one ASGI app in front of the engine replicas.

Ray Serve's HTTP proxy hands every request to this app (a Ray Serve ingress deployment).
It reads the body, renders the prompt and hashes its blocks (`PromptHasher`, on a worker
thread), and forwards the request whole, with that prompt, to the replica the router
picks, relaying the replica's response messages as they come, so streams stream.
`GET /metrics` gathers every replica's metrics instead (`metrics.merge_replica_metrics`).

Failures: a replica that dies before the client got any byte of its response is
replaced by another attempt (up to `RETRIES`, then a 503); one that dies mid-stream ends
the stream with an OpenAI error event and `[DONE]`. A client that goes away cancels the
forwarded call, which the replica's app sees as its client disconnecting.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.types import Message, Receive, Scope, Send

from engine.request.intake import RequestProcessor
from scale_out.forwarding import ForwardedRequest
from scale_out.metrics import merge_replica_metrics
from scale_out.prompt_hashes import PromptHasher
from scale_out.replica import PromptRendering
from server.capabilities import tool_calling
from server.config import ServeConfig
from server.errors import OpenAIError, error_body
from server.streaming import DONE, sse

logger = logging.getLogger(__name__)

# Further attempts for a request whose replica died before answering.
RETRIES = 2
# How long /metrics waits for the replicas.
METRICS_TIMEOUT_S = 5.0
_REQUEST_ID = b"x-request-id"


@serve.ingress()
class Ingress:
    """A Ray Serve deployment class: the ingress app over a handle to the engine replicas."""

    async def __init__(self, engine: DeploymentHandle, config: ServeConfig) -> None:
        """Waits for an engine replica, to tokenize prompts with its tokenizer."""
        hasher = None
        if config.enable_prefix_caching:
            rendering: PromptRendering = await engine.prompt_rendering.remote()
            processor = RequestProcessor(
                rendering.tokenizer, rendering.vocab_size, rendering.max_model_len
            )
            # The tools component is imported by the first chat that needs it, once.
            calling = cache(
                partial(tool_calling, config.tool_call_parser, rendering.tokenizer.chat_template)
            )
            hasher = PromptHasher(processor, calling, config.block_size)
        self._app = IngressApp(engine, hasher)

    def __serve_build_asgi_app__(self) -> IngressApp:
        return self._app


class IngressApp:
    """The ASGI app. Without a `hasher` (prefix caching off) no request carries block
    hashes, and the router balances load only."""

    def __init__(self, engine: DeploymentHandle, hasher: PromptHasher | None) -> None:
        self._engine = engine
        self._hasher = hasher
        # One thread: the hasher's tokenizer is not thread-safe.
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="prompt-hashes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client went away while sending
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            await self._metrics(send)
            return
        prompt = None
        if self._hasher is not None and scope["method"] == "POST":
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(
                self._hashing, self._hasher.render, scope["path"], body
            )
        request = ForwardedRequest(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=tuple((name, value) for name, value in scope["headers"]),
            body=body,
            client=tuple(scope["client"]) if scope.get("client") else None,
            prompt=prompt,
        )
        relay = asyncio.ensure_future(self._relay(request, send))
        gone = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            relay.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
        if not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()  # type: ignore[misc]

    async def _relay(self, request: ForwardedRequest, send: Send) -> None:
        """Send the response of one replica to `send`, trying another replica when one dies
        before the client got anything. The response start is held back until the first
        body part, so a replica that dies in between is retried too."""
        for attempt in range(1 + RETRIES):
            stream = self._engine.options(stream=True).handle_http.remote(request)
            held: Message | None = None
            event_stream = sent = finished = False
            try:
                async for message in stream:
                    if message["type"] == "http.response.start":
                        held = _without_request_id(message)
                        event_stream = _is_event_stream(held)
                        continue
                    if held is not None:
                        await send(held)
                        held = None
                    await send(message)
                    sent = True
                finished = True
            except RayActorError as exc:
                if sent:
                    logger.warning("a replica died mid-response to %s: %s", request.path, exc)
                    await _break_off(send, event_stream)
                    return
                logger.warning(
                    "a replica died before answering %s (attempt %d): %s",
                    request.path,
                    attempt + 1,
                    exc,
                )
            except Exception as exc:  # a bug in a replica or in Ray: not worth retrying
                logger.exception("forwarding %s failed", request.path)
                if sent:
                    await _break_off(send, event_stream)
                else:
                    message = f"the ingress could not forward the request: {type(exc).__name__}"
                    await _send_error(send, OpenAIError(500, message, type="server_error"))
                return
            finally:
                if not finished:
                    stream.cancel()
            if finished:
                if not sent:  # the replica's app ended without a response: a bug there
                    error = OpenAIError(502, "the replica sent no response", type="server_error")
                    await _send_error(send, error)
                return
        message = f"no replica could serve the request: {1 + RETRIES} attempts failed"
        await _send_error(send, OpenAIError(503, message, type="service_unavailable"))

    async def _metrics(self, send: Send) -> None:
        """Every live replica's metrics; a 503 if they do not all answer in time."""
        try:
            async with asyncio.timeout(METRICS_TIMEOUT_S):
                broadcast = self._engine.broadcast("metrics")
                results = await broadcast.results_async(return_exceptions=True)
        except TimeoutError:
            message = f"the replicas' metrics did not arrive within {METRICS_TIMEOUT_S:g} s"
            await _send_error(send, OpenAIError(503, message, type="service_unavailable"))
            return
        expositions = dict(result for result in results if isinstance(result, tuple))
        body = merge_replica_metrics(expositions)
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _without_request_id(start: Message) -> Message:
    """The replica's response start without its X-Request-Id: Ray Serve's proxy adds the
    same id (the client's, or one it generated and passed on to the replica)."""
    headers = [(name, value) for name, value in start["headers"] if name.lower() != _REQUEST_ID]
    return {**start, "headers": headers}


async def _break_off(send: Send, event_stream: bool) -> None:
    """End a response whose replica died after part of it was sent: a stream gets an
    OpenAI error event and `[DONE]`, as the server ends a stream the engine failed; other
    responses just end, short."""
    error = OpenAIError(
        502,
        "the replica serving this request failed; the output is incomplete",
        type="server_error",
    )
    events = (sse(error_body(error)) + DONE).encode() if event_stream else b""
    await send({"type": "http.response.body", "body": events, "more_body": False})


def _is_event_stream(start: Message) -> bool:
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in start["headers"]
    )


async def _send_error(send: Send, error: OpenAIError) -> None:
    body = json.dumps(error_body(error)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
