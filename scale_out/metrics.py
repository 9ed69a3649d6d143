"""`GET /metrics` of the ingress: every replica's own exposition, each sample labelled with
the replica it came from.

The series are the server's (`pagedserve_*` and their `vllm:*` twins), so a dashboard of one
server reads N replicas by summing over `replica` (or averaging the ratios). A replica
that does not answer is left out of that scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


def merge_replica_metrics(expositions: Mapping[str, str]) -> bytes:
    """One Prometheus text exposition of all `expositions` (replica id -> its text): each
    family once, with every replica's samples, labelled `replica="<id>"`."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(expositions.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.samples.append(
                    sample._replace(labels={**sample.labels, REPLICA_LABEL: replica})
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector that yields fixed families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families
