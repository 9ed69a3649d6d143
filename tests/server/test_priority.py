"""Priority scheduling over HTTP with the real clients: under a full KV cache, an
interactive request (priority 0) sent behind 64 batch requests (priority 10) finishes
first under `--scheduling-policy priority`, and does not under fcfs; fcfs refuses any
other priority by name on every endpoint.

The KV cache holds one sequence at a time: 9 blocks of 16 tokens for prompts of 5 blocks
(80 tokens) that grow by 64 tokens, so while one runs no other prompt fits. The engine
sleeps before each step (`slow_engine`), so that the batch is queued whole before the
first batch request can finish.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache import bytes_per_block
from server.config import ServeConfig
from tests.server.conftest import client, live_server, slow_engine, tiny_config

BATCH = 64
PROMPT_TOKENS = 80
MAX_TOKENS = 64
BLOCK_SIZE = 16
# The tiny Llama's block: 2 layers, 2 KV heads of 32, fp32.
KV_CACHE_MEMORY = 9 * bytes_per_block(2, BLOCK_SIZE, 2, 32, 4)


def config(model: Path, policy: str) -> ServeConfig:
    return tiny_config(
        model,
        served_model_name="tiny",
        scheduling_policy=policy,
        block_size=BLOCK_SIZE,
        kv_cache_memory=KV_CACHE_MEMORY,
        max_model_len=PROMPT_TOKENS + MAX_TOKENS,  # 9 blocks, all of the cache
    )


@pytest.fixture(scope="module")
def fcfs_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    with live_server(config(tiny_model_paths["llama"], "fcfs"), llm_factory=slow_engine) as url:
        yield url


@pytest.fixture(scope="module")
def priority_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    with live_server(config(tiny_model_paths["llama"], "priority"), llm_factory=slow_engine) as url:
        yield url


def prompt(index: int) -> list[int]:
    """Token ids, the first one distinct per request, so no two share a cached block."""
    return [3 + index] + [40] * (PROMPT_TOKENS - 1)


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if set(sample.labels) <= {"model_name"}
    }


async def wait_for(http: httpx.AsyncClient, **expected: float) -> dict[str, float]:
    """The first /metrics scrape whose pagedserve_<name> samples equal `expected`."""
    for _ in range(400):
        current = await metrics(http)
        if all(current.get(f"pagedserve_{k}") == v for k, v in expected.items()):
            return current
        await asyncio.sleep(0.025)
    raise AssertionError(f"/metrics never showed {expected}: {current}")


async def first_to_finish(url: str, batch_priority: int) -> tuple[str, dict[str, float]]:
    """Queue BATCH streamed completions at `batch_priority`, then, while the first of them
    runs and the rest wait, an interactive one at priority 0; return the name of the first
    request to finish and /metrics as it was then. Every stream is closed before this
    returns, and the server is back to no sequence and no used KV block."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    finished: list[str] = []

    async def complete(name: str, index: int, priority: int) -> None:
        stream = await api.completions.create(
            model="tiny",
            prompt=prompt(index),
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "priority": priority},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finished.append(name)

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        tasks = [
            asyncio.create_task(complete(f"batch-{i}", i, batch_priority)) for i in range(BATCH)
        ]
        # The cache is full: one batch request runs, the other 63 wait behind it.
        await wait_for(http, num_requests_running=1, num_requests_waiting=BATCH - 1)
        assert not finished
        tasks.append(asyncio.create_task(complete("interactive", BATCH, 0)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a request that failed fails the test
            at_first_finish = await metrics(http)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await api.close()
        await wait_for(http, num_requests_running=0, num_requests_waiting=0, kv_cache_used_blocks=0)
    return finished[0], at_first_finish


def test_the_cache_holds_one_request_at_a_time(priority_server: str) -> None:
    blocks = httpx.get(f"{priority_server}/metrics").text
    assert re.search(r'^pagedserve_kv_cache_blocks\{model_name="[^"]+"\} 9\.0$', blocks, re.M)


def test_an_interactive_request_overtakes_the_batch_under_priority(priority_server: str) -> None:
    first, at_first_finish = asyncio.run(first_to_finish(priority_server, batch_priority=10))
    assert first == "interactive"
    # It preempted the running batch request; the batch waited, every one of them.
    assert at_first_finish["pagedserve_num_preemptions_total"] >= 1
    assert at_first_finish["pagedserve_num_requests_waiting"] == BATCH


def test_an_interactive_request_waits_its_turn_under_fcfs(fcfs_server: str) -> None:
    first, at_first_finish = asyncio.run(first_to_finish(fcfs_server, batch_priority=0))
    assert first.startswith("batch-")
    assert at_first_finish["pagedserve_num_preemptions_total"] == 0


def test_fcfs_refuses_a_priority_by_name_on_every_endpoint(fcfs_server: str) -> None:
    openai_api = client(fcfs_server)
    expected = "priority 10 needs the priority scheduling policy"
    with pytest.raises(openai.BadRequestError, match=expected) as chat:
        openai_api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"priority": 10},
        )
    with pytest.raises(openai.BadRequestError, match=expected) as completion:
        openai_api.completions.create(
            model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 10}
        )
    with pytest.raises(openai.BadRequestError, match=expected) as response:
        openai_api.responses.create(
            model="tiny", input="hi", max_output_tokens=1, extra_body={"priority": 10}
        )
    for error in (chat.value, completion.value, response.value):
        assert error.body is not None and error.body["param"] == "priority"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match=expected):
        anthropic.Anthropic(base_url=fcfs_server, api_key="unused", max_retries=0).messages.create(
            model="tiny",
            max_tokens=1,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"priority": 10},
        )
    # Priority 0 is every request's under fcfs: accepted.
    reply = openai_api.completions.create(
        model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 0, "ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("value", ["1", 1.5, True, None])
def test_a_priority_must_be_an_integer(priority_server: str, value: object) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "priority": value}
    response = httpx.post(f"{priority_server}/v1/completions", json=body)
    if value is None:  # null: the default, 0
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


def test_priorities_below_zero_and_on_each_endpoint_are_served(priority_server: str) -> None:
    openai_api = client(priority_server)
    chat = openai_api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"priority": -5, "ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    message = anthropic.Anthropic(
        base_url=priority_server, api_key="unused", max_retries=0
    ).messages.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"priority": 3, "temperature": 0},
    )
    assert message.stop_reason == "max_tokens"
    response = openai_api.responses.create(
        model="tiny", input="hi", max_output_tokens=2, temperature=0, extra_body={"priority": 1}
    )
    assert response.status == "incomplete"
