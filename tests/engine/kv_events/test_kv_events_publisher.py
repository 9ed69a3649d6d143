"""The ZMQ publisher of KV-cache events speaks vLLM's wire format and replay protocol, on
real sockets: a subscriber decodes each event exactly, sequence numbers count batches from
0 without gaps, topics filter, a DEALER client replays what it missed from the buffer,
full queues drop whole batches, and bind errors fail at construction."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_events import zmq_publisher
from engine.kv_events.zmq_publisher import ZmqEventPublisher
from engine.kv_events_config import KVEventsConfig
from tests.support.kv_events import free_endpoint

END = b"\xff" * 8
MAX_HASH = 2**64 - 1
PROBE = [AllBlocksCleared("GPU")]
Publish = Callable[..., tuple[ZmqEventPublisher, str, str]]


@pytest.fixture
def sockets() -> Iterator[Callable[[int], zmq.Socket]]:
    """Client sockets of a test, closed at its end."""
    opened: list[zmq.Socket] = []

    def open_socket(kind: int) -> zmq.Socket:
        opened.append(zmq.Context.instance().socket(kind))
        return opened[-1]

    yield open_socket
    for client in opened:
        client.close(linger=0)


@pytest.fixture
def publisher() -> Iterator[Publish]:
    """Starts a publisher on free ports; gives it, its endpoint and its replay endpoint."""
    started: list[ZmqEventPublisher] = []

    def start(**settings: Any) -> tuple[ZmqEventPublisher, str, str]:
        endpoint, replay = free_endpoint(), free_endpoint()
        config = KVEventsConfig(
            enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, **settings
        )
        started.append(ZmqEventPublisher(config))
        return started[-1], endpoint, replay

    yield start
    for each in started:
        each.close()


def subscribe(open_socket: Callable[[int], zmq.Socket], endpoint: str, topic: str) -> zmq.Socket:
    sub = open_socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket) -> tuple[bytes, int, bytes]:
    assert sub.poll(3000), "no batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def join(pub: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """Publishes probes until the subscriber gets them (ZMQ's slow joiner), reads every
    probe after the first it got, and gives the sequence number of the next batch."""
    sent = 0
    while not sub.poll(100):
        pub.publish(PROBE)
        sent += 1
        assert sent < 50, "the subscriber never joined"
    while receive(sub)[1] != sent - 1:
        pass
    return sent


def replay(dealer: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
    """The batches from `start`, up to the end marker, as a DEALER asks for them (vLLM's
    example subscriber uses a REQ socket, which receives only the first reply)."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        assert dealer.poll(10_000), "the replay did not end"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if not payload:
            assert seq == END
            return batches
        batches.append((int.from_bytes(seq, "big"), payload))


def test_events_decode_exactly(publisher: Publish, sockets: Callable[[int], zmq.Socket]) -> None:
    pub, endpoint, _ = publisher(topic="kv-events")
    sub = subscribe(sockets, endpoint, "kv-events")
    join(pub, sub)
    stored = BlockStored((0, MAX_HASH), None, (1, 2, 3, 4), 2, "GPU")
    chained = BlockStored((2**63,), MAX_HASH, (5, 6), 2, "CPU")
    before = time.time()
    pub.publish([stored, chained, BlockRemoved((MAX_HASH, 7), "CPU"), AllBlocksCleared("GPU")])
    topic, _, payload = receive(sub)
    ts, events = msgpack.unpackb(payload, raw=False)
    assert topic == b"kv-events"
    assert type(ts) is float and before <= ts <= time.time()
    assert events == [
        ["BlockStored", [0, MAX_HASH], None, [1, 2, 3, 4], 2, None, "GPU", None],
        ["BlockStored", [2**63], MAX_HASH, [5, 6], 2, None, "CPU", None],
        ["BlockRemoved", [MAX_HASH, 7], "CPU"],
        ["AllBlocksCleared"],
    ]
    assert all(type(value) is int for value in [*events[0][1], *events[0][3], events[1][2]])
    assert b"\xcf" + MAX_HASH.to_bytes(8, "big") in payload  # msgpack's uint64


def test_sequence_numbers_count_batches_from_zero(
    publisher: Publish, sockets: Callable[[int], zmq.Socket]
) -> None:
    pub, endpoint, replay_endpoint = publisher()
    sub = subscribe(sockets, endpoint, "")
    first = join(pub, sub)
    for i in range(20):
        pub.publish([BlockRemoved((i,), "GPU")])
    received = [receive(sub) for _ in range(20)]
    assert [seq for _, seq, _ in received] == list(range(first, first + 20))
    assert [msgpack.unpackb(p)[1] for _, _, p in received] == [
        [["BlockRemoved", [i], "GPU"]] for i in range(20)
    ]
    dealer = sockets(zmq.DEALER)
    dealer.connect(replay_endpoint)
    assert [seq for seq, _ in replay(dealer, 0)] == list(range(first + 20))


def test_topics_filter(publisher: Publish, sockets: Callable[[int], zmq.Socket]) -> None:
    pub, endpoint, _ = publisher(topic="kv-events")
    other = subscribe(sockets, endpoint, "other")
    sub = subscribe(sockets, endpoint, "kv-events")
    join(pub, sub)
    time.sleep(0.3)  # the other subscription has joined too
    pub.publish([BlockRemoved((1,), "GPU")])
    assert receive(sub)[0] == b"kv-events"
    assert not other.poll(300)


def test_replay_sends_the_missed_batches(
    publisher: Publish, sockets: Callable[[int], zmq.Socket]
) -> None:
    pub, endpoint, replay_endpoint = publisher()
    sub = subscribe(sockets, endpoint, "")
    first = join(pub, sub)
    for i in range(5):
        pub.publish([BlockRemoved((i,), "GPU")])
    live = [receive(sub) for _ in range(5)]
    dealer = sockets(zmq.DEALER)
    dealer.connect(replay_endpoint)
    assert replay(dealer, first + 2) == [(seq, payload) for _, seq, payload in live[2:]]
    assert replay(dealer, first + 5) == []
    assert len(replay(dealer, 0)) == first + 5


def test_replay_keeps_the_last_buffer_steps(
    publisher: Publish, sockets: Callable[[int], zmq.Socket]
) -> None:
    pub, _, replay_endpoint = publisher(buffer_steps=1200)
    for i in range(1500):
        pub.publish([BlockRemoved((i,), "GPU")])
    dealer = sockets(zmq.DEALER)
    dealer.connect(replay_endpoint)
    deadline = time.monotonic() + 30  # 1,500 sends, each replay 1,200: slow on a busy CPU
    while not (batches := replay(dealer, 0)) or batches[-1][0] != 1499:
        assert time.monotonic() < deadline
    assert [seq for seq, _ in batches] == list(range(300, 1500))
    assert msgpack.unpackb(batches[0][1])[1] == [["BlockRemoved", [300], "GPU"]]


def test_malformed_replay_requests_are_ignored(
    publisher: Publish, sockets: Callable[[int], zmq.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    pub, _, replay_endpoint = publisher()
    pub.publish(PROBE)
    undelimited, short, dealer = sockets(zmq.DEALER), sockets(zmq.REQ), sockets(zmq.DEALER)
    for client in (undelimited, short, dealer):
        client.connect(replay_endpoint)
    with caplog.at_level(logging.WARNING, logger=zmq_publisher.__name__):
        undelimited.send(b"\x00" * 8)
        short.send(b"\x00")
        deadline = time.monotonic() + 5
        while not replay(dealer, 0):
            assert time.monotonic() < deadline
    assert not undelimited.poll(200) and not short.poll(0)
    assert [r.message for r in caplog.records].count(
        "KV events: ignored a malformed replay request (and any later)"
    ) == 1


def test_a_full_queue_drops_whole_batches(
    publisher: Publish,
    sockets: Callable[[int], zmq.Socket],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    entered, release = threading.Event(), threading.Event()
    encode = zmq_publisher.encode_batch

    def held_encode(*args: Any) -> bytes:
        entered.set()
        assert release.wait(5)
        return encode(*args)

    monkeypatch.setattr(zmq_publisher, "encode_batch", held_encode)
    pub, _, replay_endpoint = publisher(max_queue_size=1)
    with caplog.at_level(logging.WARNING, logger=zmq_publisher.__name__):
        pub.publish([BlockRemoved((0,), "GPU")])
        assert entered.wait(5)  # the thread holds batch 0; the queue takes one more
        for i in range(1, 5):
            pub.publish([BlockRemoved((i,), "GPU")])
    release.set()
    assert pub.dropped == 3
    assert sum("dropped a batch" in r.message for r in caplog.records) == 1
    dealer = sockets(zmq.DEALER)
    dealer.connect(replay_endpoint)
    deadline = time.monotonic() + 5
    while len(batches := replay(dealer, 0)) < 2:
        assert time.monotonic() < deadline
    assert [(seq, msgpack.unpackb(p)[1]) for seq, p in batches] == [
        (0, [["BlockRemoved", [0], "GPU"]]),
        (1, [["BlockRemoved", [1], "GPU"]]),
    ]


@pytest.mark.parametrize("key", ["endpoint", "replay_endpoint"])
def test_a_port_in_use_fails_at_construction(
    key: str, sockets: Callable[[int], zmq.Socket]
) -> None:
    taken = free_endpoint()
    sockets(zmq.PUB).bind(taken)
    settings = {"endpoint": free_endpoint(), "replay_endpoint": free_endpoint(), key: taken}
    with pytest.raises(ValueError) as caught:
        ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, **settings))
    message = str(caught.value)
    assert message.startswith(f"kv_events_config.{key}: cannot bind {taken!r}")
    assert "\n" not in message
    # the other socket was closed: its endpoint binds again
    ZmqEventPublisher(KVEventsConfig(**{**settings, key: free_endpoint()})).close()


def test_a_bad_endpoint_fails_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^kv_events_config\.endpoint: cannot bind 'nowhere'"):
        ZmqEventPublisher(KVEventsConfig(endpoint="nowhere"))


def test_close_sends_the_queue_and_is_idempotent(publisher: Publish) -> None:
    pub, endpoint, replay_endpoint = publisher()
    for i in range(200):
        pub.publish([BlockRemoved((i,), "GPU")])
    pub.close()
    assert not pub._thread.is_alive()
    assert pub._next_seq == 200 and pub.dropped == 0
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(PROBE)
    config = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)
    ZmqEventPublisher(config).close()  # the sockets are closed: the ports bind again
