"""One engine replica: a whole pagedserve server (its engine, KV cache and prefix cache)
in a Ray Serve replica, answering the requests the ingress forwards.

The replica runs the server's own app (`server.app.build_app`), lifespan included, and
answers each forwarded request through it (`forwarding.call_app`), so its responses,
errors, metrics and disconnect handling are exactly `pagedserve serve`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import logging
import socket
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from starlette.types import Message

from scale_out.forwarding import ForwardedRequest, call_app
from scale_out.router import KV_EVENTS_ENDPOINT, KV_EVENTS_REPLAY, NUM_KV_BLOCKS
from server.app import build_app
from server.config import LOG_FORMAT, ServeConfig
from server.state import ServerState

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# The response header naming the replica that answered (its Ray Serve replica id).
REPLICA_HEADER = b"x-pagedserve-replica"


@dataclass(frozen=True, slots=True)
class PromptRendering:
    """What the ingress needs to tokenize prompts as this replica does: a copy of the
    engine's tokenizer (chat template included) and the engine's limits."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    max_model_len: int


class EngineReplica:
    """A Ray Serve deployment class. Invariant: once constructed, the engine is loaded and
    `replica_id` names this replica in responses, metrics and the router's index."""

    async def __init__(self, config: ServeConfig) -> None:
        """Build the server's app and run its lifespan until the engine has loaded; a
        failed load fails the replica (Ray Serve reports the deployment unhealthy)."""
        logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
        self.replica_id = serve.get_replica_context().replica_tag
        config, self._events_endpoints = _with_kv_events(config)
        self._app = build_app(config)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self._app.router.lifespan_context(self._app))
        state: ServerState = self._app.state.server
        model = state.models.first
        while model.llm is None and model.load_error is None:
            await asyncio.sleep(0.05)
        if model.llm is None:
            await self._lifespan.aclose()
            raise RuntimeError(f"the engine failed to load: {model.load_error}")
        self._state = state
        self._llm = llm = model.llm
        # Copied before any request runs, so never while the engine thread decodes with it.
        self._rendering = PromptRendering(
            copy.deepcopy(llm.engine.tokenizer), llm.engine.vocab_size, llm.max_model_len
        )

    async def handle_http(self, request: ForwardedRequest) -> AsyncGenerator[Message, None]:
        """The server's response to `request`, as ASGI messages (called with
        `stream=True`). Cancelling the call is the client disconnecting."""
        header = (REPLICA_HEADER, self.replica_id.encode())
        async with contextlib.aclosing(call_app(self._app, request, [header])) as messages:
            async for message in messages:
                yield message

    def metrics(self) -> tuple[str, str]:
        """This replica's id and its `/metrics` text (for the ingress's `/metrics`)."""
        return self.replica_id, self._state.metrics.render().decode()

    def prompt_rendering(self) -> PromptRendering:
        return self._rendering

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose engine loop died is replaced."""
        if not self._llm.is_healthy:
            raise RuntimeError("the engine loop has stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads about this replica: the capacity of its KV cache, and
        where it publishes and replays its KV events (None: it does not)."""
        endpoint, replay = self._events_endpoints
        return {
            NUM_KV_BLOCKS: self._llm.num_kv_blocks,
            KV_EVENTS_ENDPOINT: endpoint,
            KV_EVENTS_REPLAY: replay,
        }

    async def __del__(self) -> None:
        # Ray Serve's graceful stop: the lifespan's exit stops the engine thread.
        await self._lifespan.aclose()


def _with_kv_events(config: ServeConfig) -> tuple[ServeConfig, tuple[str | None, str | None]]:
    """`config` publishing KV events for the router, and the endpoints the router connects
    to (events, replay): the user's `kv_events_config` where it enables them, else two free
    ports of this node. None (and no events) where pyzmq or msgpack is not installed."""
    events = config.kv_events_config
    if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
        endpoint, replay = events.endpoint, events.replay_endpoint
    elif any(importlib.util.find_spec(name) is None for name in ("zmq", "msgpack")):
        return config, (None, None)
    else:
        endpoint, replay = f"tcp://*:{_free_port()}", f"tcp://*:{_free_port()}"
        settings = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                    "replay_endpoint": replay}  # fmt: skip
        config = ServeConfig.model_validate({**config.model_dump(), "kv_events_config": settings})
    node = ray.util.get_node_ip_address()
    return config, (endpoint.replace("*", node, 1), replay and replay.replace("*", node, 1))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])
