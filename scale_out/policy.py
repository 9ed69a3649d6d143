"""Which replicas a prompt should go to: the routing decision, apart from Ray.

Cache affinity while the load is balanced, load when it is not (SGLang's cache-aware
policy, with a prediction of the replicas' caches from `prefix_index`):

- If the replicas' ongoing requests differ by more than `imbalance_threshold`, the least
  loaded replicas: a replica that falls behind gets no new work, however well its cache
  matches.
- Else the replicas predicted to hold the longest prefix of the prompt, if that is at
  least `min_match_ratio` of its full blocks: a hit saves that prefix's prefill. A
  shorter match is not worth steering for: every prompt of a chat template starts with
  the same few tokens, and such a match would send all traffic to one replica.
- Else (a new prefix) the least loaded replica, the one predicted to hold the fewest blocks
  among equals: new prefixes spread over the replicas, so each keeps its own share of the
  working set rather than a copy of all of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K")


def preferred_replicas(
    loads: Mapping[K, int],
    matched: Mapping[K, int],
    sizes: Mapping[K, int],
    num_blocks: int,
    *,
    imbalance_threshold: int,
    min_match_ratio: float,
) -> list[K]:
    """The replicas to try first, among those in `loads` (their ongoing requests), for a
    prompt of `num_blocks` full blocks; `matched` is each one's predicted matched prefix
    in blocks, `sizes` its predicted cache size in blocks. Never empty when `loads` is
    not."""
    if not loads:
        return []
    lightest = min(loads.values())
    if max(loads.values()) - lightest > imbalance_threshold:
        return [replica for replica, load in loads.items() if load == lightest]
    best = max(matched.get(replica, 0) for replica in loads)
    if best > 0 and best >= min_match_ratio * num_blocks:
        return [replica for replica in loads if matched.get(replica, 0) == best]
    return [min(loads, key=lambda replica: (loads[replica], sizes.get(replica, 0)))]
