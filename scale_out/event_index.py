"""The router's view of each replica's KV tiers, from the replicas' own KV events.

Each replica publishes vLLM's KV events over ZMQ (`engine/kv_events/`): which blocks its
KV tensor and its disk tier hold from now on (`BlockStored`) and which they no longer hold
(`BlockRemoved`, `AllBlocksCleared`). A subscriber thread reads every replica's stream and
keeps, per replica and medium, the set of block hashes held; a prompt's match on a replica
is the run of its leading block hashes held in any medium, as the replica's own lookup
(memory first, then the tier) finds it. Unlike the router's guess from what it routed
(`PrefixIndex`), this sees the other traffic, the generated tokens' blocks, the exact
evictions and the disk tier's blocks, which outlive the KV tensor and restarts.

Where a replica also has a replay endpoint, its buffered batches are asked for as soon as
it is followed (so a router that starts after its replicas learns what they announced
before) and whenever a sequence number is skipped; without one, a missed batch is logged
and the view goes on from the next (an error costs a cache miss, never a wrong answer: a
replica checks every hit).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

POLL_MS = 100
# How long a replay may take to answer before the view goes on without it.
REPLAY_TIMEOUT_MS = 2000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventIndex:
    """Per replica, the block hashes each of its media holds, as its events say.

    Invariants: `_held[replica][medium]` is the set of hashes whose latest event for that
    medium was a BlockStored, since the replica's first event or last AllBlocksCleared; it
    is read and written under `_lock`. `_next_seq[replica]` is the sequence number expected
    next on its stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Hashable, dict[str, set[int]]] = {}
        self._endpoints: dict[Hashable, str] = {}
        self._replays: dict[Hashable, str] = {}
        self._next_seq: dict[Hashable, int] = {}
        self._context = zmq.Context()
        self._new: list[Hashable] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-index", daemon=True)
        self._thread.start()

    def follow(self, replica: Hashable, endpoint: str, replay: str | None = None) -> None:
        """Subscribe to `replica`'s events at `endpoint`, replaying what it buffered from
        `replay` (idempotent)."""
        with self._lock:
            if self._endpoints.get(replica) == endpoint:
                return
            self._endpoints[replica] = endpoint
            if replay is not None:
                self._replays[replica] = replay
            self._held[replica] = {}
            self._next_seq.pop(replica, None)
            self._new.append(replica)

    def follows(self, replica: Hashable) -> bool:
        with self._lock:
            return replica in self._endpoints

    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these chained hashes the replica holds
        in any medium."""
        with self._lock:
            media = list(self._held.get(replica, {}).values())
            matched = 0
            for block_hash in hashes:
                if not any(block_hash in held for held in media):
                    break
                matched += 1
        return matched

    def size(self, replica: Hashable) -> int:
        """How many blocks the replica holds, in any medium, counted once each."""
        with self._lock:
            media = self._held.get(replica, {})
            return len(set().union(*media.values())) if media else 0

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in `replicas`; its subscription ends too."""
        keep = set(replicas)
        with self._lock:
            for replica in [r for r in self._endpoints if r not in keep]:
                del self._endpoints[replica]
                self._replays.pop(replica, None)
                self._held.pop(replica, None)
                self._next_seq.pop(replica, None)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(5)

    def receive(self, replica: Hashable, seq: int, payload: bytes) -> None:
        """Take one live batch of `replica`'s stream: a batch seen already is skipped; one
        after a gap (or the first) comes after the replay of what it skipped."""
        with self._lock:
            expected = self._next_seq.get(replica)
            replay = self._replays.get(replica)
        if expected is not None and seq < expected:
            return
        if seq != expected and replay is not None:
            self._replay(replica, replay, expected or 0, seq)
        self.apply(replica, seq, payload)

    def apply(self, replica: Hashable, seq: int, payload: bytes) -> None:
        """Apply one batch of `replica`'s stream (its sequence number and msgpack payload)."""
        _, events = msgpack.unpackb(payload)
        with self._lock:
            media = self._held.get(replica)
            expected = self._next_seq.get(replica)
            if media is None or (expected is not None and seq < expected):
                return
            if expected is not None and seq > expected:
                logger.warning("KV events of %s: batches %d-%d missed", replica, expected, seq - 1)
            self._next_seq[replica] = seq + 1
            for event in events:
                _apply_event(media, event)

    def _replay(self, replica: Hashable, endpoint: str, start: int, stop: int | None) -> None:
        """Apply the batches `replica` still buffers from `start` on (before `stop`)."""
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if stop is None or seq < stop:
                    self.apply(replica, seq, payload)
            logger.warning("KV events of %s: no replay from %s", replica, endpoint)
        finally:
            dealer.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        sockets: dict[Hashable, zmq.Socket] = {}
        owners: dict[zmq.Socket, Hashable] = {}
        try:
            while not self._stopped.is_set():
                self._sync_sockets(poller, sockets, owners)
                for socket, _ in poller.poll(POLL_MS):
                    _, seq, payload = socket.recv_multipart()
                    self.receive(owners[socket], int.from_bytes(seq, "big"), payload)
        finally:
            for socket in sockets.values():
                socket.close(linger=0)
            self._context.term()

    def _sync_sockets(
        self, poller: zmq.Poller, sockets: dict[Hashable, zmq.Socket],
        owners: dict[zmq.Socket, Hashable],
    ) -> None:  # fmt: skip
        """Open the subscriptions asked for since the last call, close the forgotten ones."""
        with self._lock:
            new, self._new = self._new, []
            followed = dict(self._endpoints)
            replays = {replica: self._replays.get(replica) for replica in new}
        for replica in [r for r in sockets if r not in followed]:
            socket = sockets.pop(replica)
            poller.unregister(socket)
            del owners[socket]
            socket.close(linger=0)
        for replica in new:
            if replica not in followed:
                continue
            if replica in sockets:
                poller.unregister(sockets[replica])
                sockets[replica].close(linger=0)
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(followed[replica])
            sockets[replica] = socket
            owners[socket] = replica
            poller.register(socket, zmq.POLLIN)
            replay = replays[replica]
            if replay is not None:  # what it announced before this router followed it
                self._replay(replica, replay, 0, None)


def _apply_event(media: dict[str, set[int]], event: list[Any]) -> None:
    """One decoded event (vLLM's array form, `engine.kv_events.zmq_publisher`)."""
    tag = event[0]
    if tag == "BlockStored":
        media.setdefault(event[6] or "", set()).update(event[1])
    elif tag == "BlockRemoved":
        media.get(event[2] or "", set()).difference_update(event[1])
    elif tag == "AllBlocksCleared":
        media.clear()
