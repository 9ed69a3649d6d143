"""A client that goes away aborts its request: nothing keeps running or holding blocks."""

from __future__ import annotations

import time

import httpx

from tests.server.conftest import (
    BOTH_STEP_ORDERS,
    engine_metrics,
    wait_until_idle,
)

pytestmark = BOTH_STEP_ORDERS

LONG = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 450, "ignore_eos": True}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 450,
    "ignore_eos": True,
}


def test_streams_closed_mid_way_free_everything(tiny_server: str) -> None:
    before = engine_metrics(tiny_server)["pagedserve_generation_tokens_total"]
    with httpx.Client(timeout=30) as http:
        for path, body in [
            ("completions", {**LONG, "stream": True, "n": 2}),
            (
                "chat/completions",
                {**CHAT, "stream": True},
            ),
        ]:
            with http.stream("POST", f"{tiny_server}/v1/{path}", json=body) as response:
                lines = response.iter_lines()
                received = [next(lines) for _ in range(6)]
                assert all(line.startswith("data: ") or not line for line in received)
    metrics = wait_until_idle(tiny_server)
    assert metrics["pagedserve_num_requests_running"] == 0
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    generated = metrics["pagedserve_generation_tokens_total"] - before
    assert generated < 3 * LONG["max_tokens"] / 2, "the aborted requests ran to the end"


def test_non_streaming_client_timeout_frees_everything(tiny_server: str) -> None:
    before = engine_metrics(tiny_server)["pagedserve_generation_tokens_total"]
    sent = time.monotonic()
    try:
        # 3 x 450 tokens take the tiny model about half a second: the client leaves well before.
        httpx.post(f"{tiny_server}/v1/completions", json={**LONG, "n": 3}, timeout=0.2)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the request was expected to outlast the client's timeout")
    metrics = wait_until_idle(tiny_server)
    assert metrics["pagedserve_num_requests_running"] == 0
    assert metrics["pagedserve_kv_cache_used_blocks"] == 0
    generated = metrics["pagedserve_generation_tokens_total"] - before
    assert generated < 3 * LONG["max_tokens"], f"ran {time.monotonic() - sent:.1f}s to the end"
