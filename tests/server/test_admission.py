"""Overload and deadlines: 429s with Retry-After beyond the queue bound, 504s when a deadline
passes queued or running, and nothing left holding KV blocks afterwards."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from server.admission import (
    FALLBACK_RETRY_AFTER,
    MAX_RETRY_AFTER,
    Admission,
    max_queued,
    request_deadline,
)
from server.config import ServeConfig
from server.errors import OpenAIError
from tests.server.conftest import (
    engine_metrics,
    live_server,
    tiny_config,
    wait_until_idle,
    wait_until_running,
)

SLOTS = 2  # max_num_seqs
QUEUE = 2  # max_queued_requests
REJECTED = "pagedserve_requests_rejected_total"
TIMED_OUT = "pagedserve_requests_timed_out_total"
# Long enough to hold a slot for seconds; such requests are always cut short by a test.
LONG = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 2000, "ignore_eos": True}
TIMEOUT = {"X-Request-Timeout": "0.3"}


@pytest.fixture(scope="module")
def busy_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    config = tiny_config(
        tiny_model_paths["llama"],
        served_model_name="tiny",
        max_model_len=2048,
        max_num_seqs=SLOTS,
        max_queued_requests=QUEUE,
    )
    with live_server(config) as url:
        yield url


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The `data:` payloads of a whole stream, parsed, with the final "[DONE]" as is."""
    payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_a_burst_beyond_the_queue_gets_429s_and_health_stays_fast(busy_server: str) -> None:
    rejected_before = engine_metrics(busy_server)[REJECTED]
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
    url = f"{busy_server}/v1/completions"
    health_seconds = []
    with ThreadPoolExecutor(10 * QUEUE) as pool:
        futures = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(10 * QUEUE)]
        while not all(future.done() for future in futures):
            start = time.monotonic()
            assert httpx.get(f"{busy_server}/health").status_code == 200
            health_seconds.append(time.monotonic() - start)
            time.sleep(0.01)
        responses = [future.result() for future in futures]
    done = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(done) + len(refused) == len(responses)
    assert len(done) >= SLOTS and refused, [r.status_code for r in responses]
    for response in done:
        assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert max(health_seconds) < 1.0, f"/health took up to {max(health_seconds):.2f}s"
    metrics = wait_until_idle(busy_server)
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    assert metrics[REJECTED] - rejected_before == len(refused)
    # Every admitted request gave its share back: the queue is empty again.
    for stream in [False, True]:
        after = httpx.post(url, json=body | {"max_tokens": 2, "stream": stream}, timeout=60)
        assert after.status_code == 200


def test_a_deadline_passing_in_the_queue_fails_it_and_frees_nothing(busy_server: str) -> None:
    timed_out_before = engine_metrics(busy_server)[TIMED_OUT]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.Client(timeout=30) as http, ExitStack() as blockers:
        for _ in range(SLOTS):
            stream = http.stream(
                "POST", f"{busy_server}/v1/completions", json=LONG | {"stream": True}
            )
            blockers.enter_context(stream)
        wait_until_running(busy_server, SLOTS)
        response = http.post(f"{busy_server}/v1/completions", json=LONG, headers=TIMEOUT)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "queue_timeout"
        with http.stream(
            "POST", f"{busy_server}/v1/chat/completions", json=chat, headers=TIMEOUT
        ) as streamed:
            events = sse_events(streamed)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "queue_timeout"
        assert all(
            e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:-2]
        )
        # The blockers run on, untouched; nothing is left waiting.
        metrics = engine_metrics(busy_server)
        assert metrics["pagedserve_num_requests_running"] == SLOTS
        assert metrics["pagedserve_num_requests_waiting"] == 0
        assert metrics["pagedserve_kv_cache_used_blocks"] > 0
    metrics = wait_until_idle(busy_server)
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    assert metrics[TIMED_OUT] - timed_out_before == 2


def test_a_deadline_passing_while_running_aborts_it(busy_server: str) -> None:
    before = engine_metrics(busy_server)
    with httpx.Client(timeout=30) as http:
        sent = time.monotonic()
        response = http.post(f"{busy_server}/v1/completions", json=LONG, headers=TIMEOUT)
        assert time.monotonic() - sent < 5
        assert response.status_code == 504
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
        assert "stopped after" in error["message"]
        body = LONG | {"stream": True}
        with http.stream(
            "POST", f"{busy_server}/v1/completions", json=body, headers=TIMEOUT
        ) as streamed:
            events = sse_events(streamed)
    # The partial output, then the error, then [DONE]; no choice claims to have finished.
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    chunks = events[:-2]
    assert chunks and all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    metrics = wait_until_idle(busy_server)
    assert metrics["pagedserve_num_requests_running"] == 0
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    generated = (
        metrics["pagedserve_generation_tokens_total"] - before["pagedserve_generation_tokens_total"]
    )
    assert generated < LONG["max_tokens"], "the timed-out requests ran to the end"
    assert metrics[TIMED_OUT] - before[TIMED_OUT] == 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_admission(waiting: list[int], clock: FakeClock, rejections: list[int]) -> Admission:
    return Admission(
        max_queued=4,
        capacity=2,
        engine_waiting=lambda: waiting[0],
        on_reject=lambda: rejections.append(1),
        clock=clock,
    )


def test_admission_counts_sequences_and_refuses_a_full_queue() -> None:
    waiting, clock, rejections = [0], FakeClock(), []
    admission = make_admission(waiting, clock, rejections)
    first = admission.admit(3)  # n=3: one running slot short, so one sequence queued
    assert admission.queued() == 1
    second = admission.admit(4)  # admitted while under the bound; now 5 queued
    assert admission.queued() == 5
    with pytest.raises(OpenAIError) as refused:
        admission.admit(1)
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    assert refused.value.headers == {"Retry-After": str(FALLBACK_RETRY_AFTER)}
    assert rejections == [1]
    second.release()
    second.release()  # a second release gives nothing back twice
    assert admission.load == 3
    # Sequences waiting for KV blocks count even below the slots' capacity.
    waiting[0] = 4
    with pytest.raises(OpenAIError):
        admission.admit(1)
    waiting[0] = 0
    with first:
        pass
    assert admission.load == 0


def test_retry_after_follows_the_drain_rate() -> None:
    clock, rejections = FakeClock(), []
    admission = make_admission([0], clock, rejections)
    assert admission.retry_after(10) == FALLBACK_RETRY_AFTER
    for _ in range(4):  # 2 sequences a second over 4 s
        admission.record_finished(4)
        clock.now += 2.0
    assert admission.drain_rate() == pytest.approx(16 / 8)
    assert admission.retry_after(10) == 5
    assert admission.retry_after(1) == 1  # never 0
    assert admission.retry_after(10_000) == MAX_RETRY_AFTER
    clock.now += 120  # the window forgets old finishes
    assert admission.retry_after(10) == FALLBACK_RETRY_AFTER


def http_request(headers: dict[str, str]) -> Request:
    raw = [(key.lower().encode(), value.encode()) for key, value in headers.items()]
    return Request({"type": "http", "headers": raw})


def test_the_timeout_header_only_shortens_the_server_timeout() -> None:
    config = ServeConfig(model="m", request_timeout=10)
    no_header = request_deadline(config, http_request({}))
    assert no_header is not None and no_header.timeout == 10
    shorter = request_deadline(config, http_request({"X-Request-Timeout": "2.5"}))
    assert shorter is not None and shorter.timeout == 2.5
    longer = request_deadline(config, http_request({"X-Request-Timeout": "60"}))
    assert longer is not None and longer.timeout == 10
    unbounded = ServeConfig(model="m")
    assert request_deadline(unbounded, http_request({})) is None
    header_only = request_deadline(unbounded, http_request({"X-Request-Timeout": "60"}))
    assert header_only is not None and header_only.timeout == 60
    for bad in ["0", "-1", "soon", "nan", "inf"]:
        with pytest.raises(OpenAIError) as error:
            request_deadline(config, http_request({"X-Request-Timeout": bad}))
        assert (error.value.status, error.value.param) == (400, "X-Request-Timeout")


def test_the_default_queue_bound_scales_with_the_running_slots() -> None:
    assert max_queued(ServeConfig(model="m", max_num_seqs=8)) == 32
    assert max_queued(ServeConfig(model="m", max_num_seqs=8, max_queued_requests=3)) == 3
