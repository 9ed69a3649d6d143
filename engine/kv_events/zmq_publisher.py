"""Publishes KV-cache events over ZMQ exactly as vLLM's `ZmqEventPublisher` does, so that
a router written for vLLM's events (its example subscriber, llm-d, Dynamo) reads ours.

Wire format: each batch is one PUB message `[topic, seq (8 bytes, big-endian), payload]`,
the payload msgpack of vLLM's array-like `KVEventBatch`: `[ts, [event, ...]]`, an event
an array led by its tag: `["BlockStored", hashes, parent, token_ids, block_size, lora_id,
medium, lora_name]` (`lora_id` always None: adapters are named, not numbered),
`["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]`. A client may ask the ROUTER
at `replay_endpoint` for every buffered batch from a sequence number on (`[b"", start]`,
8 bytes big-endian, from a DEALER: a REQ socket takes only the first reply); the answer is
`[b"", seq, payload]` per batch, then `[b"", -1 (8 bytes, signed), b""]`.

Invariants: sequence numbers start at 0 and increase by exactly one per batch sent; a
batch is sent whole or dropped whole (its queue full, or a failed send), and a drop
takes no sequence number and is counted in `ZmqEventPublisher.dropped`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from cache.events import BlockRemoved, BlockStored, KVEvent
from engine.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CLOSE_TIMEOUT_S = 10.0
# How long one replay may wait for a slow client's queue, in all, before it gives up.
REPLAY_TIMEOUT_S = 10.0


def _send_replayed(replay: zmq.Socket, frames: list[bytes], deadline: float) -> None:
    """Send one replayed batch, waiting while the client's queue is full (on a busy
    machine its reader may lag a burst of a thousand); zmq.Again past `deadline`, and
    zmq.ZMQError if the client is gone."""
    while True:
        try:
            replay.send_multipart(frames, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.002)  # a ROUTER polls writable whatever one peer's queue holds


def encode_event(event: KVEvent) -> list[Any]:
    """One event as vLLM's msgspec tagged, array-like struct encodes it."""
    if isinstance(event, BlockStored):
        hashes, parent, tokens = event.block_hashes, event.parent_block_hash, event.token_ids
        return [
            "BlockStored", hashes, parent, tokens, event.block_size, None, event.medium,
            event.lora_name,
        ]  # fmt: skip
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]  # vLLM's has no fields: the medium is not sent


def encode_batch(ts: float, events: Sequence[KVEvent]) -> bytes:
    return msgpack.packb([ts, [encode_event(event) for event in events]], use_bin_type=True)


def _bind(socket: zmq.Socket, key: str, endpoint: str) -> None:
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as error:
        raise ValueError(f"kv_events_config.{key}: cannot bind {endpoint!r}: {error}") from None


class ZmqEventPublisher:
    """vLLM's PUB/ROUTER publisher with a replay buffer of the last `buffer_steps` batches.

    `publish` never blocks: it queues the batch (at most `max_queue_size` wait) or drops it
    whole and counts it. A daemon thread owns the sockets from construction on: it
    encodes, numbers and sends each batch, keeps it for replay, and answers replays.
    Both endpoints are bound (vLLM connects an endpoint without `*`; pagedserve binds it
    too), in the constructor, so that a port in use fails there."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.dropped = 0
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, tuple[KVEvent, ...]]] = queue.Queue(
            maxsize=config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._warned_malformed = False
        # a context of its own, terminated at close: then the ports are free when it returns
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            _bind(self._pub, "endpoint", config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # a whole replay fits in the client's queue (the default keeps 1000); past
                # it a send waits for room (`_send_replayed`) instead of being dropped
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _bind(self._replay, "replay_endpoint", config.replay_endpoint)
        except BaseException:
            self._close_zmq()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue `events` as one batch, stamped now; when the queue is full, drop it."""
        batch = (time.time(), tuple(events))
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV events publisher is closed")
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self._count_drop("the queue of kv_events_config.max_queue_size is full")

    def close(self) -> None:
        """Send what is queued, then close the sockets; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not end in %.0f s", CLOSE_TIMEOUT_S)

    def _count_drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1:
            logger.warning("KV events: dropped a batch (%s); later drops are only counted", why)

    def _run(self) -> None:
        try:
            while True:
                while self._replay is not None and self._replay.poll(0):
                    try:
                        self._serve_replay(self._replay)
                    except zmq.ZMQError:
                        logger.exception("KV events: could not answer a replay request")
                try:
                    ts, events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                self._send(ts, events)
        finally:
            self._close_zmq()

    def _send(self, ts: float, events: tuple[KVEvent, ...]) -> None:
        try:
            payload = encode_batch(ts, events)
            self._pub.send_multipart([self._topic, self._next_seq.to_bytes(8, "big"), payload])
        except Exception:
            logger.exception("KV events: could not send a batch")
            with self._lock:
                self._count_drop("it could not be sent")
            return
        self._buffer.append((self._next_seq, payload))
        self._next_seq += 1

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            if not self._warned_malformed:
                self._warned_malformed = True
                logger.warning("KV events: ignored a malformed replay request (and any later)")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        for seq, payload in self._buffer:
            if seq >= first:
                _send_replayed(replay, [client, b"", seq.to_bytes(8, "big"), payload], deadline)
        _send_replayed(replay, [client, b"", END_SEQ, b""], deadline)

    def _close_zmq(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
