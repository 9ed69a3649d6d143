"""The Ray Serve ingress over two tiny replicas: prefix affinity, disconnects, and a
replica killed mid-stream. (The server's conformance tests of /v1/completions,
/v1/chat/completions and errors run against the ingress too: `RAY_INGRESS` in
tests/server/conftest.py.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")

from tests.server.conftest import client, tiny_config
from tests.support.ray_serve import REPLICAS, deployed, replica_metrics

pytestmark = pytest.mark.ray

REPLICA_HEADER = "x-pagedserve-replica"


@pytest.fixture(scope="module")
def tiny_server(serve_url: str, tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    """The ingress over two replicas of the tiny Llama served as 'tiny'."""
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny")
    with deployed(serve_url, config) as url:
        yield url


def chat_body(system: str, question: str, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, **extra}


def test_requests_sharing_a_prefix_land_on_one_replica(tiny_server: str) -> None:
    systems = [
        f"You are assistant number {i}. " + "Answer in one short word. " * 6 for i in range(4)
    ]
    placed: dict[int, set[str]] = {i: set() for i in range(len(systems))}
    cached: dict[int, list[int]] = {i: [] for i in range(len(systems))}
    for question in ("Name a colour.", "Count to three.", "Say hello."):
        for i, system in enumerate(systems):
            response = httpx.post(
                f"{tiny_server}/v1/chat/completions", json=chat_body(system, question), timeout=30
            )
            assert response.status_code == 200, response.text
            placed[i].add(response.headers[REPLICA_HEADER])
            cached[i].append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    # Every later question of a tenant reuses the KV blocks of its system prompt.
    assert all(later > 32 for counts in cached.values() for later in counts[1:]), cached
    # New prefixes go to the replica predicted to hold the fewest blocks: both get tenants.
    assert len(set().union(*placed.values())) == REPLICAS


def total(metrics: dict[str, dict[str, float]], name: str) -> float:
    return sum(samples[name] for samples in metrics.values())


def wait_until_idle(url: str, timeout: float = 10.0) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = replica_metrics(url)
        busy = sum(
            total(metrics, name)
            for name in (
                "pagedserve_num_requests_running",
                "pagedserve_num_requests_waiting",
                "pagedserve_kv_cache_used_blocks",
            )
        )
        if not busy or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_a_client_that_goes_away_frees_the_replicas_blocks(tiny_server: str) -> None:
    long = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 450, "ignore_eos": True}
    metrics = replica_metrics(tiny_server)
    assert len(metrics) == REPLICAS
    before = total(metrics, "pagedserve_generation_tokens_total")
    with httpx.Client(timeout=30) as http:
        for path, body in [
            ("completions", {**long, "stream": True, "n": 2}),
            ("chat/completions", {**chat_body("Hi", "Hi"), "max_tokens": 450, "stream": True}),
        ]:
            with http.stream("POST", f"{tiny_server}/v1/{path}", json=body) as response:
                lines = response.iter_lines()
                received = [next(lines) for _ in range(6)]
                assert all(line.startswith("data: ") or not line for line in received)
        with pytest.raises(httpx.TimeoutException):
            http.post(f"{tiny_server}/v1/completions", json={**long, "n": 3}, timeout=0.5)
    metrics = wait_until_idle(tiny_server)
    assert total(metrics, "pagedserve_num_requests_running") == 0
    assert total(metrics, "pagedserve_kv_cache_used_blocks") == 0
    generated = total(metrics, "pagedserve_generation_tokens_total") - before
    assert generated < 3 * long["max_tokens"], "the abandoned requests ran to the end"


def test_a_killed_replica_fails_its_streams_and_the_endpoint_keeps_serving(
    tiny_server: str,
) -> None:
    import ray

    from scale_out.launch import APP_NAME

    body = {"model": "tiny", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, ExitStack() as stack:
        streams = [
            stack.enter_context(
                http.stream(
                    "POST",
                    f"{tiny_server}/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": f"Tenant {i}"}]},
                )
            )
            for i in range(4)
        ]
        victim = streams[0].headers[REPLICA_HEADER]
        replica = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#engine#{victim}", namespace="serve")
        ray.kill(replica, no_restart=True)
        for stream in streams:
            events = [line for line in stream.iter_lines() if line]
            assert events[-1] == "data: [DONE]"
            last = json.loads(events[-2].removeprefix("data: "))
            if stream.headers[REPLICA_HEADER] == victim:
                assert last["error"]["type"] == "server_error", last
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
    api = client(tiny_server)
    for i in range(4):
        reply = api.chat.completions.create(**chat_body(f"After {i}", "Hi"))
        assert reply.choices[0].finish_reason == "length"
    # Ray Serve starts a replica in the dead one's place.
    deadline = time.monotonic() + 180
    while True:
        replicas = set(replica_metrics(tiny_server))
        if len(replicas) == REPLICAS and victim not in replicas:
            break
        assert time.monotonic() < deadline, f"the replica was not replaced: {replicas}"
        time.sleep(0.5)
