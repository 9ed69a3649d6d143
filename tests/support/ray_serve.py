"""Ray Serve for the tests: a local cluster of its own, Serve applications of tiny
replicas behind the scale-out ingress, and the replicas' metrics as the ingress reports
them. Ray is imported only when a cluster starts, so the tests that need none run without
it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.tables import free_port
from server.config import ServeConfig

# Logical CPUs of the test cluster: one per replica, whatever the machine has.
REPLICA_CPUS = 1
REPLICAS = 2


# Starts of a cluster whose proxy lost its port: a free port is picked before Ray starts,
# and its own processes (or the other test worker's) may bind it first.
PORT_ATTEMPTS = 3


@contextmanager
def local_cluster() -> Iterator[str]:
    """Ray Serve on a local cluster, its HTTP proxy on a free port (its URL), shut down
    when the block exits."""
    from scale_out.launch import local_serve

    for attempt in range(1, PORT_ATTEMPTS + 1):
        stack = ExitStack()
        try:
            url = stack.enter_context(local_serve(REPLICAS * REPLICA_CPUS, free_port()))
        except Exception as exc:  # Ray wraps the proxy's bind error in its task error
            if "Failed to bind" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
            continue
        with stack:
            yield url
        return


@contextmanager
def deployed(serve_url: str, config: ServeConfig, **scale_out: Any) -> Iterator[str]:
    """`config` served by REPLICAS replicas behind the ingress at `serve_url` until the
    block exits."""
    from ray import serve

    from scale_out.launch import APP_NAME, ScaleOut, build_application
    from tests.server.conftest import wait_healthy

    plan = ScaleOut(replicas=REPLICAS, replica_cpus=REPLICA_CPUS, **scale_out)
    serve.run(build_application(config, plan, REPLICA_CPUS), name=APP_NAME, route_prefix="/")
    try:
        wait_healthy(serve_url)
        yield serve_url
    finally:
        serve.delete(APP_NAME)


@contextmanager
def ingress(config: ServeConfig) -> Iterator[str]:
    """`config` behind the ingress on a cluster of its own, until the block exits."""
    with local_cluster() as serve_url, deployed(serve_url, config) as url:
        yield url


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """The series of every replica with no label but the replica's and the model's, from
    the ingress's /metrics: replica -> sample name -> value."""
    by_replica: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = dict(sample.labels)
            replica = labels.pop("replica")
            labels.pop("model_name", None)
            if not labels:
                by_replica.setdefault(replica, {})[sample.name] = sample.value
    return by_replica
