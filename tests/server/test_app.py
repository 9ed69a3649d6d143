"""Health while loading and after a failed load, metrics, version, per-app registries."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from server.app import build_app
from tests.server.conftest import client, engine_metrics, live_server, tiny_config, wait_healthy


def test_health_is_503_until_the_engine_is_loaded(tiny_model_paths: dict[str, Path]) -> None:
    release = threading.Event()

    def slow_factory(config: EngineConfig) -> AsyncLLM:
        release.wait(timeout=60)
        return AsyncLLM.from_config(config)

    config = tiny_config(tiny_model_paths["qwen3"])
    with live_server(config, wait_ready=False, llm_factory=slow_factory) as url:
        health = httpx.get(f"{url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        early = httpx.post(f"{url}/v1/completions", json={"model": "qwen3", "prompt": "Hi"})
        assert early.status_code == 503
        assert "loading" in early.json()["error"]["message"]
        release.set()
        wait_healthy(url)
        result = client(url).completions.create(model="qwen3", prompt="Hi", max_tokens=2)
        assert result.usage.completion_tokens == 2


def test_failed_load_is_reported_and_health_stays_503(tmp_path: Path) -> None:
    failures: list[BaseException] = []
    config = tiny_config(tmp_path / "no-such-model")
    with live_server(config, wait_ready=False, on_load_error=failures.append) as url:
        while not failures:
            time.sleep(0.02)
        assert isinstance(failures[0], ModelLoadError)
        health = httpx.get(f"{url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "failed"})


def test_metrics_count_tokens_and_latencies(tiny_server: str) -> None:
    before = engine_metrics(tiny_server)
    result = client(tiny_server).completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=5,
        n=2,
        extra_body={"ignore_eos": True},
    )
    after = engine_metrics(tiny_server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("pagedserve_prompt_tokens_total") == result.usage.prompt_tokens * 2
    assert grew("pagedserve_generation_tokens_total") == result.usage.completion_tokens == 10
    assert grew("pagedserve_prefix_cache_queries_total") > 0
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert grew(f"pagedserve_{histogram}_seconds_count") == 1
    assert after["pagedserve_kv_cache_blocks"] > 0
    assert 0 <= after["pagedserve_kv_cache_usage_ratio"] <= 1


def test_version(tiny_server: str) -> None:
    assert httpx.get(f"{tiny_server}/version").json()["version"]


def test_apps_have_their_own_registries(tiny_model_paths: dict[str, Path]) -> None:
    config = tiny_config(tiny_model_paths["llama"])
    first, second = build_app(config), build_app(config)
    assert first.state.server.metrics.registry is not second.state.server.metrics.registry
    # Before an engine exists only the histograms are exported.
    assert b"pagedserve_e2e_request_latency_seconds" in first.state.server.metrics.render()
    assert b"num_requests_running" not in second.state.server.metrics.render()


def test_metrics_show_prefix_blocks_kept_after_a_request(tiny_server: str) -> None:
    prompt = "Paged attention keeps keys and values in fixed-size blocks. " * 4
    client(tiny_server).completions.create(model="tiny", prompt=prompt, max_tokens=2)
    after = engine_metrics(tiny_server)
    # Its full prompt blocks were registered, then freed with their hashes kept.
    assert after["pagedserve_kv_cache_cached_free_blocks"] >= 2
    assert after["pagedserve_prefix_cache_evictions_total"] >= 0


def test_a_bug_while_loading_is_logged_with_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only failures the settings caused are one-line errors; a ValueError from a bug is not."""
    failures: list[BaseException] = []

    def buggy_factory(config: EngineConfig) -> AsyncLLM:
        raise ValueError("a bug, not a setting")

    config = tiny_config(tmp_path / "unused")
    with (
        caplog.at_level(logging.ERROR, logger="server.model_pool"),
        live_server(
            config, wait_ready=False, llm_factory=buggy_factory, on_load_error=failures.append
        ),
    ):
        while not failures:
            time.sleep(0.02)
    (record,) = [r for r in caplog.records if r.name == "server.model_pool"]
    assert record.exc_info is not None and "cannot start the engine" in record.getMessage()


def test_a_settings_error_while_loading_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[BaseException] = []
    with (
        caplog.at_level(logging.ERROR, logger="server.model_pool"),
        live_server(
            tiny_config(tmp_path / "no-such-model"), wait_ready=False, on_load_error=failures.append
        ),
    ):
        while not failures:
            time.sleep(0.02)
    (record,) = [r for r in caplog.records if r.name == "server.model_pool"]
    assert record.exc_info is None and "not found" in record.getMessage()
