"""The Ray Serve request router of the engine replicas: prefix-cache affinity with a load
guard (the decision is `policy.preferred_replicas`, the cache prediction `PrefixIndex`).

Ray Serve runs one router per deployment handle, in the process that holds the handle:
here, the ingress. It calls `choose_replicas` for each request with the request's
arguments, a `ForwardedRequest` whose block hashes the ingress computed, and hears which
replica accepted it (`on_request_routed`), which is when the prediction is updated. The
replicas' queue lengths come from Ray's queue-length cache (kept by this handle's own
sends and completions, probed when stale). Each replica reports its number of KV blocks
as routing stats (`EngineReplica.record_routing_stats`), which bounds its prediction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from scale_out.forwarding import ForwardedRequest
from scale_out.policy import preferred_replicas
from scale_out.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from ray.serve.request_router import ReplicaResult

# The routing-stats key under which a replica reports its number of KV-cache blocks.
NUM_KV_BLOCKS = "num_kv_blocks"


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
        first = preferred_replicas(
            loads,
            {r: self._index.matched_blocks(r, hashes) for r in loads},
            {r: self._index.size(r) for r in loads},
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

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._index.retain(self.curr_replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.retain(self.curr_replicas)

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
