"""The Ray Serve request router of the engine replicas: prefix-cache affinity with a load
guard (the decision is `policy.preferred_replicas`, the cache prediction `PrefixIndex`).

Ray Serve runs one router per deployment handle, in the process that holds the handle:
here, the ingress. It calls `choose_replicas` for each request with the request's
arguments, a `ForwardedRequest` whose block hashes the ingress computed, and hears which
replica accepted it (`on_request_routed`), which is when the prediction is updated. The
replicas' queue lengths come from Ray's queue-length cache (kept by this handle's own
sends and completions, probed when stale). Each replica reports its number of KV blocks
as routing stats (`EngineReplica.record_routing_stats`), which bounds its prediction, and
where it publishes its KV events: a replica's match is the longer of what was routed to it
(`PrefixIndex`) and what its events say its KV tensor and disk tier hold (`EventIndex`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from scale_out.event_index import EventIndex
from scale_out.forwarding import ForwardedRequest
from scale_out.policy import preferred_replicas
from scale_out.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from ray.serve.request_router import ReplicaResult

# The routing-stats keys under which a replica reports its number of KV-cache blocks and
# where it publishes its KV events.
NUM_KV_BLOCKS = "num_kv_blocks"
KV_EVENTS_ENDPOINT = "kv_events_endpoint"
KV_EVENTS_REPLAY = "kv_events_replay_endpoint"


class PrefixAwareRouter(RequestRouter):
    """Routes a request to the replica most likely to hold its prompt's prefix blocks, or
    to the least loaded one while load is unbalanced or for a new prefix.

    Returns two ranks: the preferred replicas, then the others, which Ray tries when the
    preferred ones are full (`max_ongoing_requests`). Requests without block hashes
    (health checks, tokenization, invalid bodies) go to the least loaded replica.
    """

    def initialize_state(self, imbalance_threshold: int = 16, min_match_ratio: float = 0.5) -> None:
        """Called by Ray Serve with the deployment's `request_router_kwargs`; the two
        thresholds are `policy.preferred_replicas`'s (the kinds SGLang's cache-aware router
        has). A replica may run 16 requests more than another before affinity gives way:
        on a CPU a cache miss of a long prompt costs seconds of prefill, more than waiting
        behind that many requests' decode steps."""
        self._index = PrefixIndex()
        self._events: EventIndex | None = None
        self._imbalance_threshold = imbalance_threshold
        self._min_match_ratio = min_match_ratio

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hashes = _block_hashes(pending_request)
        if not hashes or len(candidate_replicas) < 2:
            return [candidate_replicas]
        loads = await self._queue_lengths(candidate_replicas)
        ids = {replica.replica_id: replica for replica in candidate_replicas}
        events = {r: self._events_of(ids[r]) for r in loads}
        first = preferred_replicas(
            loads,
            {r: self._matched_blocks(r, hashes, events[r]) for r in loads},
            {r: (events[r] or self._index).size(r) for r in loads},
            len(hashes),
            imbalance_threshold=self._imbalance_threshold,
            min_match_ratio=self._min_match_ratio,
        )
        if not first:
            return [candidate_replicas]
        rest = [replica for replica_id, replica in ids.items() if replica_id not in first]
        return [[ids[replica_id] for replica_id in first], rest]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        hashes = _block_hashes(pending_request)
        if hashes:
            replica = self.curr_replicas.get(replica_id)
            stats: dict[str, Any] = (replica.routing_stats if replica else None) or {}
            self._index.record(replica_id, hashes, stats.get(NUM_KV_BLOCKS))

    def _events_of(self, replica: RunningReplica) -> EventIndex | None:
        """The index of the replica's own events where it publishes them (followed from the
        first time its routing stats say where), else None."""
        stats = replica.routing_stats or {}
        endpoint = stats.get(KV_EVENTS_ENDPOINT)
        if endpoint is None:
            return None
        if self._events is None:
            self._events = EventIndex()
        self._events.follow(replica.replica_id, endpoint, stats.get(KV_EVENTS_REPLAY))
        return self._events

    def _matched_blocks(
        self, replica: ReplicaID, hashes: tuple[int, ...], events: EventIndex | None
    ) -> int:
        """The longer of two matches: what was routed to the replica (current the moment a
        request is routed, before the replica has computed, let alone announced, its
        blocks) and what its events say it holds (its disk tier and other routers'
        traffic included, which the routed prediction cannot see)."""
        routed = self._index.matched_blocks(replica, hashes)
        return routed if events is None else max(routed, events.matched_blocks(replica, hashes))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._retain()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._retain()

    def _retain(self) -> None:
        self._index.retain(self.curr_replicas)
        if self._events is not None:
            self._events.retain(self.curr_replicas)

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's ongoing requests, from the cache or a probe; a replica that does
        not answer a probe is left out."""
        lengths: dict[ReplicaID, int] = {}
        stale = []
        for replica in replicas:
            length = self.replica_queue_len_cache.get(replica.replica_id)
            if length is None:
                stale.append(replica)
            else:
                lengths[replica.replica_id] = length
        if stale:
            for replica, length in await self._probe_queue_lens(stale, 0):
                if length is not None:
                    lengths[replica.replica_id] = length
        return lengths


def _block_hashes(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    request = pending_request.args[0]
    return request.block_hashes if isinstance(request, ForwardedRequest) else ()
