"""One local Ray cluster for the scale-out tests, and Serve applications of tiny replicas.

Ray is imported only by these fixtures, so the tests that need no cluster run without it;
the ones that do skip where Ray is not installed (`make test` installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.tables import free_port
from server.config import ServeConfig
from tests.server.conftest import wait_healthy

# Logical CPUs of the test cluster: one per replica, whatever the machine has.
REPLICA_CPUS = 1
REPLICAS = 2


@pytest.fixture(scope="package")
def serve_url() -> Iterator[str]:
    """Ray Serve on a local cluster, its HTTP proxy on a free port; torn down after this
    package's last test, so that its daemons do not share the cores with the tests of the
    packages that run later."""
    pytest.importorskip("ray")
    from scale_out.launch import local_serve

    with local_serve(REPLICAS * REPLICA_CPUS, free_port()) as url:
        yield url


@contextmanager
def deployed(serve_url: str, config: ServeConfig, **scale_out: Any) -> Iterator[str]:
    """`config` served by REPLICAS replicas behind the ingress at `serve_url` until the
    block exits."""
    from ray import serve

    from scale_out.launch import APP_NAME, ScaleOut, build_application

    plan = ScaleOut(replicas=REPLICAS, replica_cpus=REPLICA_CPUS, **scale_out)
    serve.run(build_application(config, plan, REPLICA_CPUS), name=APP_NAME, route_prefix="/")
    try:
        wait_healthy(serve_url)
        yield serve_url
    finally:
        serve.delete(APP_NAME)


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
