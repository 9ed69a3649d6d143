"""`pagedserve ray-serve`: the Ray Serve application of N engine replicas behind the ingress,
and the command that runs it.

Ray: a local cluster started for the command, or the existing one named by `RAY_ADDRESS`
(`ray.init` reads it). Every node that runs a replica needs pagedserve installed and the
model reachable at the same path.

Resources: each replica is a Ray actor holding `replica_cpus` CPUs (and `replica_gpus`
GPUs), and its torch uses that many threads (OMP_NUM_THREADS, set before torch loads);
the ingress holds none (it only tokenizes and relays).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from scale_out.ingress import Ingress
from scale_out.replica import EngineReplica
from scale_out.router import PrefixAwareRouter
from server.admission import max_queued
from server.config import ServeConfig

logger = logging.getLogger(__name__)

APP_NAME = "pagedserve"
Routing = Literal["prefix", "pow2"]
# How often replicas report their KV-cache size to the router (seconds).
ROUTING_STATS_PERIOD_S = 2.0


@dataclass(frozen=True, slots=True)
class ScaleOut:
    """How many replicas, what each holds, and how requests are routed: 'prefix'
    (`PrefixAwareRouter`) or 'pow2' (Ray Serve's default power-of-two-choices router).
    `replica_cpus` None: the cluster's CPUs shared equally, at least 1 each;
    `replica_gpus` None: one with `device: cuda`, else none."""

    replicas: int = 2
    replica_cpus: float | None = None
    replica_gpus: float | None = None
    routing: Routing = "prefix"

    def cpus_each(self, cluster_cpus: float) -> float:
        if self.replica_cpus is not None:
            return self.replica_cpus
        return max(1, math.floor(cluster_cpus / self.replicas))


def build_application(config: ServeConfig, scale_out: ScaleOut, cpus_each: float) -> Application:
    """The Serve application: the ingress bound to `scale_out.replicas` engine replicas
    serving `config`, `cpus_each` CPUs and as many torch threads each."""
    router = RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    if scale_out.routing == "prefix":
        router = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    threads = max(1, math.floor(cpus_each))
    gpus = scale_out.replica_gpus
    if gpus is None:
        gpus = 1 if config.device == "cuda" else 0
    engine = serve.deployment(EngineReplica).options(
        name="engine",
        num_replicas=scale_out.replicas,
        # Everything the server's own admission control accepts; it answers 429 beyond.
        max_ongoing_requests=config.max_num_seqs + max_queued(config),
        request_router_config=router,
        ray_actor_options={
            "num_cpus": cpus_each,
            "num_gpus": gpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
    )
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        num_replicas=1,
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(config), config)


@contextmanager
def local_serve(num_cpus: float, port: int) -> Iterator[str]:
    """A local Ray cluster of `num_cpus` logical CPUs with Serve's HTTP proxy on loopback
    `port` (its URL); Serve and the cluster are shut down on exit. For tests and
    benchmarks, which need a quiet cluster of their own."""
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def serve_replicas(config: ServeConfig, scale_out: ScaleOut) -> int:
    """Run the application on Ray until SIGINT or SIGTERM, then shut it down."""
    import ray

    ray.init(logging_level=config.log_level.upper())
    cpus_each = scale_out.cpus_each(ray.cluster_resources().get("CPU", 1))
    serve.start(http_options={"host": config.host, "port": config.port})
    try:
        serve.run(build_application(config, scale_out, cpus_each), name=APP_NAME, route_prefix="/")
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        host = f"[{config.host}]" if ":" in config.host else config.host
        logger.info(
            "OpenAI-compatible API at http://%s:%d/v1: %d replicas of %s CPUs, %s routing",
            host,
            config.port,
            scale_out.replicas,
            cpus_each,
            scale_out.routing,
        )
        stop.wait()
    except KeyboardInterrupt:  # during start-up
        pass
    finally:
        # On a cluster of its own the command stops Serve; on a shared one, its app only.
        if os.environ.get("RAY_ADDRESS"):
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0
