"""The KV events' test helpers: a free ZMQ endpoint, and a subscriber's batches."""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import zmq


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def receive(sub: zmq.Socket, quiet: float = 1.0) -> list[tuple[int, list[Any]]]:
    """Every batch until none arrives for `quiet` seconds: (sequence number, events)."""
    batches = []
    while sub.poll(int(quiet * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        batches.append((int.from_bytes(seq, "big"), events))
    return batches
