"""Sleep, served as `make serve` serves (the default model, real HTTP, `pagedserve serve`
processes): `/sleep` gives the KV cache's memory back (level 2 the mapped weights' too),
the first request after it answers exactly as before, by endpoint and after
`sleep_idle_seconds`; /health does not wake the engine; bad calls are refused by name."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from engine.model.device import cpu_has_fast_bf16
from tests.server.conftest import engine_metrics
from tests.server.serve_process import serve_process

pytestmark = pytest.mark.slow

# SmolLM2-135M: 30 layers of K and V, 3 KV heads of 64, in the dtype `auto` picks here.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * (2 if cpu_has_fast_bf16() else 4)
SETTINGS = ["--config", "configs/default.yaml", "--kv-cache-memory", "512MiB",
            "--kv-disk-size", "0"]  # fmt: skip
PROMPT = "A short history of the river towns of the north: " + "boats, bridges and mills. " * 40


def complete(url: str, max_tokens: int = 12) -> dict[str, Any]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "logprobs": 2}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    return {"text": choice["text"], "logprobs": choice["logprobs"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "tokens": usage["total_tokens"]}  # fmt: skip


def answer(result: dict[str, Any]) -> tuple:
    return result["text"], result["logprobs"]


def rss(process: subprocess.Popen) -> int:
    return psutil.Process(process.pid).memory_info().rss


def is_sleeping(url: str) -> bool:
    return httpx.get(f"{url}/is_sleeping").json()["is_sleeping"]


def test_sleep_gives_memory_back_and_the_next_request_answers_as_before(tmp_path: Path):
    started: list[subprocess.Popen] = []
    with serve_process(SETTINGS, tmp_path / "log", started=started) as url:
        first = complete(url)
        assert complete(url)["cached"] > 0  # the prefix cache holds the prompt
        assert not is_sleeping(url)
        before = rss(started[0])
        response = httpx.post(f"{url}/sleep", params={"level": 1}, timeout=60)
        assert response.status_code == 200, response.text
        report = response.json()
        assert report["is_sleeping"] and report["level"] == 1
        # The KV pages the requests wrote (the cache takes pages as it is written).
        written = first["tokens"] * KV_BYTES_PER_TOKEN
        assert before - rss(started[0]) > 0.9 * written
        assert report["released_bytes"] > 0.9 * written
        assert httpx.get(f"{url}/health").status_code == 200
        assert is_sleeping(url)  # /health did not wake it
        assert engine_metrics(url)["pagedserve_sleep_level"] == 1
        woken = complete(url)
        assert answer(woken) == answer(first)
        assert woken["cached"] == 0  # the prefix cache was forgotten with the KV
        assert not is_sleeping(url)

        awake = rss(started[0])
        level2 = httpx.post(f"{url}/sleep?level=2", timeout=60).json()
        assert level2["level"] == 2
        # The KV the last request touched, and the mapped weights' pages.
        assert awake - rss(started[0]) > level2["released_bytes"] * 0.5 > 0
        assert httpx.post(f"{url}/wake_up", timeout=60).json() == {"is_sleeping": False}
        assert answer(complete(url)) == answer(first)


def test_sleep_waits_for_the_requests_in_flight(tmp_path: Path):
    with serve_process(SETTINGS, tmp_path / "log") as url:
        alone = complete(url, max_tokens=64)
        results: list[dict[str, Any]] = []
        running = threading.Thread(target=lambda: results.append(complete(url, max_tokens=64)))
        running.start()
        time.sleep(0.3)  # the request is in the engine
        assert httpx.post(f"{url}/sleep", timeout=300).status_code == 200
        running.join()
        assert answer(results[0]) == answer(alone)  # finished whole, then the engine slept
        assert is_sleeping(url)


def test_idle_engine_sleeps_and_the_next_request_wakes_it(tmp_path: Path):
    with serve_process([*SETTINGS, "--sleep-idle-seconds", "1"], tmp_path / "log") as url:
        first = complete(url)
        deadline = time.monotonic() + 30
        while not is_sleeping(url):
            assert time.monotonic() < deadline, "the idle engine did not sleep"
            time.sleep(0.2)
        assert engine_metrics(url)["pagedserve_sleep_level"] == 2
        for _ in range(3):
            assert httpx.get(f"{url}/health").status_code == 200
        assert is_sleeping(url)
        assert answer(complete(url)) == answer(first)
        assert not is_sleeping(url)


def test_bad_sleep_calls_are_refused_by_name(tmp_path: Path):
    with serve_process(SETTINGS, tmp_path / "log") as url:
        for path, params, name in [
            ("/sleep", {"level": 3}, "level"),
            ("/sleep", {"level": "deep"}, "level"),
            ("/sleep", {"levels": 1}, "levels"),
            ("/wake_up", {"tags": "weights"}, "tags"),
        ]:
            response = httpx.post(f"{url}{path}", params=params, timeout=60)
            assert response.status_code == 400, (path, params)
            assert response.json()["error"]["param"] == name
        assert not is_sleeping(url)
