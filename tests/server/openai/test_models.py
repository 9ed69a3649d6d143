"""Several models in one server (real HTTP; a tiny Llama and a tiny Qwen3 of other
weights as two models): requests routed by `model`, each answered as a server of that model alone
answers it; loads on demand, LRU at `max_loaded_models`, `keep_alive` (0, a duration, -1,
per model and per request), the load and unload endpoints, unknown models, and the
metrics labelled by model."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from server.config import ServeConfig
from tests.server.conftest import live_server, scrape, tiny_config
from tests.server.serve_process import serve_process
from tests.support.tiny_models import build_model

PROMPTS = [
    "The river towns of the north",
    "A list of fruit: apple,",
    "Once upon a time",
    "1, 2, 3,",
]


@pytest.fixture(scope="module")
def paths(
    tiny_model_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny Llama, and a tiny Qwen3 of other weights (with the same, they answer alike)."""
    qwen = build_model(tmp_path_factory.mktemp("other-qwen3"), "qwen3", seed=7)
    return {"llama": tiny_model_paths["llama"], "qwen3": qwen}


def several(paths: dict[str, Path], **settings: Any) -> ServeConfig:
    """The two tiny models served as 'llama' and 'qwen', as `tiny_config` serves one."""
    base = tiny_config(paths["llama"]).model_dump(exclude_unset=True, exclude={"model"})
    models = [
        {"name": "llama", "model": str(paths["llama"])},
        {"name": "qwen", "model": str(paths["qwen3"])},
    ]
    return ServeConfig(**(base | {"models": models} | settings))


def complete(url: str, model: str, prompt: str, **fields: Any) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def states(url: str) -> dict[str, str]:
    return {card["id"]: card["state"] for card in httpx.get(f"{url}/v1/models").json()["data"]}


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def alone(paths: dict[str, Path]) -> dict[str, list[str]]:
    """Each model's greedy answers to PROMPTS from a server that serves only it."""
    answers = {}
    for name, arch in (("llama", "llama"), ("qwen", "qwen3")):
        with live_server(tiny_config(paths[arch], served_model_name=name)) as url:
            answers[name] = [complete(url, name, prompt) for prompt in PROMPTS]
    assert answers["llama"] != answers["qwen"]
    return answers


def test_two_models_interleaved_answer_as_each_alone(
    paths: dict[str, Path], alone: dict[str, list[str]]
) -> None:
    with live_server(several(paths)) as url:
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert states(url) == {"llama": "unloaded", "qwen": "unloaded"}
        jobs = [(model, prompt) for prompt in PROMPTS for model in ("llama", "qwen")] * 2
        # Eight at once: the first of each model's requests load it, the others wait.
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda job: complete(url, *job), jobs))
        expected = [alone[model][PROMPTS.index(prompt)] for model, prompt in jobs]
        assert answers == expected
        assert states(url) == {"llama": "loaded", "qwen": "loaded"}
        cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
        assert (
            cards["qwen"]["root"] == paths["qwen3"].name and cards["qwen"]["max_model_len"] == 512
        )
        metrics = scrape(url)
        for family in ("pagedserve_generation_tokens_total", "vllm:generation_tokens_total"):
            by_model = {dict(labels)["model_name"]: v for labels, v in metrics[family].items()}
            assert by_model == {"llama": 2 * 8 * len(PROMPTS), "qwen": 2 * 8 * len(PROMPTS)}
        ttft = metrics["vllm:time_to_first_token_seconds_count"]
        assert {dict(labels)["model_name"]: v for labels, v in ttft.items()} == {
            "llama": 2 * len(PROMPTS),
            "qwen": 2 * len(PROMPTS),
        }


def test_an_unknown_model_is_a_404_in_each_apis_format(paths: dict[str, Path]) -> None:
    with live_server(several(paths)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "'llama', 'qwen'" in error["message"]
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": "claude", "max_tokens": 4, "messages": messages}
        response = httpx.post(f"{url}/v1/messages", json=body)
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"
        assert httpx.post(f"{url}/models/load", json={"model": "nope"}).status_code == 404
        assert states(url) == {"llama": "unloaded", "qwen": "unloaded"}


def test_loading_past_max_loaded_models_unloads_the_least_recently_used(
    paths: dict[str, Path], alone: dict[str, list[str]]
) -> None:
    with live_server(several(paths, max_loaded_models=1)) as url:
        assert complete(url, "llama", PROMPTS[0]) == alone["llama"][0]
        assert states(url) == {"llama": "loaded", "qwen": "unloaded"}
        assert complete(url, "qwen", PROMPTS[1]) == alone["qwen"][1]
        assert states(url) == {"llama": "unloaded", "qwen": "loaded"}
        assert complete(url, "llama", PROMPTS[2]) == alone["llama"][2]
        assert states(url) == {"llama": "loaded", "qwen": "unloaded"}


def test_keep_alive_zero_a_duration_and_for_ever(paths: dict[str, Path]) -> None:
    config = several(paths, keep_alive="1s")
    with live_server(config) as url:
        complete(url, "llama", PROMPTS[0], keep_alive=0)  # the request's own: at once
        complete(url, "qwen", PROMPTS[0])  # the server's: one second
        wait_for(lambda: states(url)["llama"] == "unloaded", timeout=5)
        assert states(url)["qwen"] == "loaded"
        wait_for(lambda: states(url)["qwen"] == "unloaded", timeout=10)
        complete(url, "qwen", PROMPTS[0], keep_alive=-1)  # pinned
        complete(url, "llama", PROMPTS[0], keep_alive="500ms")
        wait_for(lambda: states(url)["llama"] == "unloaded", timeout=10)
        time.sleep(1.5)
        assert states(url)["qwen"] == "loaded"
        response = httpx.post(f"{url}/v1/completions", json={
            "model": "qwen", "prompt": "x", "keep_alive": "soon"})  # fmt: skip
        assert response.status_code == 400 and response.json()["error"]["param"] == "keep_alive"


def test_the_load_and_unload_endpoints(paths: dict[str, Path], alone: dict[str, list[str]]) -> None:
    with live_server(several(paths, autoload=False)) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": "qwen", "prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_not_loaded"
        loaded = httpx.post(f"{url}/models/load", json={"model": "qwen"}, timeout=60).json()
        assert loaded["state"] == "loaded" and loaded["load_seconds"] > 0
        assert complete(url, "qwen", PROMPTS[3]) == alone["qwen"][3]
        unloaded = httpx.post(f"{url}/models/unload", json={"model": "qwen"}, timeout=60).json()
        assert unloaded["state"] == "unloaded" and unloaded["unload_seconds"] > 0
        assert states(url) == {"llama": "unloaded", "qwen": "unloaded"}
        # The metrics of an unloaded model's engine are gone; its latencies stay.
        assert "qwen" not in str(scrape(url).get("pagedserve_generation_tokens_total", {}))
        response = httpx.post(f"{url}/models/load", json={"name": "qwen"})
        assert response.status_code == 400
        assert httpx.post(f"{url}/models/unload", json={"model": "llama"}).status_code == 200


def test_an_unload_waits_for_the_requests_in_flight(paths: dict[str, Path]) -> None:
    with live_server(several(paths)) as url:
        complete(url, "llama", PROMPTS[0])
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(complete, url, "llama", PROMPTS[1], max_tokens=200, ignore_eos=True)
            wait_for(lambda: "pagedserve_num_requests_running" in scrape(url) and any(
                scrape(url)["pagedserve_num_requests_running"].values()))  # fmt: skip
            unload = httpx.post(f"{url}/models/unload", json={"model": "llama"}, timeout=120)
            assert long.done() and len(long.result()) > 0
        assert unload.status_code == 200 and states(url)["llama"] == "unloaded"


@pytest.mark.slow
def test_unloading_gives_back_what_loading_took(tmp_path: Path) -> None:
    """The default model, as `make serve` serves it, loaded and unloaded six times in a
    `pagedserve serve` process: each unload returns most of what its load took (the
    weights, mapped, and the KV the request wrote), and the cycles leave nothing growing."""
    settings = ["--model", "smollm2=default", "--kv-cache-memory", "512MiB",
                "--kv-disk-size", "0"]  # fmt: skip
    started: list[subprocess.Popen] = []
    body = {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with serve_process(settings, tmp_path / "log", started=started) as url:
        process = psutil.Process(started[0].pid)
        after_unload = []
        for _ in range(6):
            before = process.memory_info().rss
            assert httpx.post(
                f"{url}/models/load", json={"model": "smollm2"}, timeout=300
            ).is_success
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=300).is_success
            loaded = process.memory_info().rss
            assert httpx.post(
                f"{url}/models/unload", json={"model": "smollm2"}, timeout=300
            ).is_success
            after_unload.append(process.memory_info().rss)
            # The weights' ~100 MB at least, taken and given back (a load also leaves some
            # heap behind, and the first its libraries: the last check bounds those).
            assert loaded - before > 64 * 2**20
            assert loaded - after_unload[-1] > 64 * 2**20
        assert after_unload[-1] < 1.1 * after_unload[1]
