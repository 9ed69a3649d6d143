"""A real server on a free loopback port, in a background thread, per test module."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from server.app import build_app
from server.config import ServeConfig
from server.reasoning import END, START
from tests.support.ray_serve import ingress
from tests.support.tiny_models import build_model

# The first default-model server of a run compiles its forward: 90 s on an idle 2-core CPU,
# twice that beside the other worker's tests.
READY_TIMEOUT = 300.0
QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()


def tiny_config(model_path: Path, **settings: Any) -> ServeConfig:
    """The tiny random-weight Llama, small and fp32 so that greedy outputs are stable."""
    values: dict[str, Any] = {
        "model": str(model_path),
        "dtype": "float32",
        "device": "cpu",
        "kv_cache_memory": "64MiB",
        "max_model_len": 512,
        "enforce_eager": True,
    }
    return ServeConfig(**(values | settings))


@contextmanager
def live_server(
    config: ServeConfig, *, wait_ready: bool = True, **app_options: Any
) -> Iterator[str]:
    """Serve `build_app(config)` with uvicorn until the block exits; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(config.model_copy(update={"port": port}), **app_options)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: server.started, thread, "the server did not start")
        if wait_ready:
            wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def wait_healthy(url: str, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not become ready"
        time.sleep(0.05)


def _wait(condition: Any, thread: threading.Thread, message: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not condition():
        assert thread.is_alive() and time.monotonic() < deadline, message
        time.sleep(0.02)


def engine_metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (label-less metrics only are asked for)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


@contextmanager
def served(config: ServeConfig, where: object = None) -> Iterator[str]:
    """`config` served until the block exits, by a live server, or behind the Ray Serve
    ingress over two replicas when `where` is `RAY_INGRESS`'s value; its URL."""
    if where == "ray-ingress":
        pytest.importorskip("ray")
        with ingress(config) as url:
            yield url
    else:
        with live_server(config) as url:
            yield url


@pytest.fixture(scope="module")
def tiny_server(tiny_model_paths: dict[str, Path], request: pytest.FixtureRequest) -> Iterator[str]:
    """One server on the tiny Llama for the whole test module; its served name is 'tiny'.
    A module parametrized by `SYNC`, `ASYNC_SCHEDULING` and `RAY_INGRESS` gets one of each
    in turn."""
    where = getattr(request, "param", None)
    steps = where if isinstance(where, bool) else None
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", async_scheduling=steps
    )
    with served(config, where) as url:
        yield url


# The ways a module's tests may be served: synchronous steps (the CPU's), async
# scheduling (CUDA's default, where a step launches the next before it makes its
# outputs), and the Ray Serve ingress over two replicas (the server's conformance tests,
# run against scale-out too; a cluster of its own per module).
SYNC = pytest.param(False, id="sync")
ASYNC_SCHEDULING = pytest.param(True, id="async-scheduling")
SERVER = pytest.param(None, id="server")
RAY_INGRESS = pytest.param("ray-ingress", id="ray-ingress", marks=pytest.mark.ray)
BOTH_STEP_ORDERS = pytest.mark.parametrize("tiny_server", [SYNC, ASYNC_SCHEDULING], indirect=True)


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with Qwen3's chat template and its `<think>`, `</think>`,
    `<tool_call>` and `</tool_call>` tokens, which decode as text."""
    folder = build_model(tmp_path_factory.mktemp("tiny-qwen3-reasoning"), "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([START, END, "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


Labels = tuple[tuple[str, str], ...]


def scrape(url: str) -> dict[str, dict[Labels, float]]:
    """/metrics as sample name -> {sorted labels: value}."""
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def wait_until_idle(url: str, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = engine_metrics(url)
        idle = (
            metrics["pagedserve_num_requests_running"] == 0
            and metrics["pagedserve_num_requests_waiting"] == 0
            and metrics["pagedserve_kv_cache_used_blocks"] == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def wait_until_running(url: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while engine_metrics(url)["pagedserve_num_requests_running"] < count:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.02)


STEP_DELAY = 0.025


def slow_engine(config: EngineConfig) -> AsyncLLM:
    """A real AsyncLLM whose every step starts with a STEP_DELAY sleep."""
    llm = AsyncLLM.from_config(config)
    step = llm.engine.step

    def slow_step() -> Any:
        time.sleep(STEP_DELAY)
        return step()

    # The engine thread is idle on its command queue until the first request arrives.
    llm.engine.step = slow_step  # type: ignore[method-assign]
    return llm
