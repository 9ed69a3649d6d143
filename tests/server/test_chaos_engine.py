"""Chaos: an engine step that raises, and an engine loop that dies, seen over HTTP.

A step whose model or sampler raises fails only that batch's requests (a 500 in the
OpenAI error format, or an error event then `[DONE]` on a stream), frees their KV
blocks, and the server goes on serving. A failure outside that guard kills the engine
loop: every request in flight is failed the same way, nothing hangs, /health answers
503 and new requests a 503, and `pagedserve serve` exits (code 1) so that a supervisor
restarts it, as vLLM's server does when its engine dies.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.tables import free_port
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.sampling.params import SamplingParams
from scheduler import ScheduledSequence
from tests.server.conftest import live_server, tiny_config

# Requests in flight when the fault strikes, half of them streamed, half on each endpoint.
IN_FLIGHT = 6
# Long enough that every request is still running when the fault is injected.
MAX_TOKENS = 400
# Each request in flight must be answered within this long of the fault (a hang fails).
ANSWER_WITHIN = 20.0


@dataclass
class Answer:
    """One request's HTTP answer: its status, body (a whole response) or events (a
    stream), and when it was complete (time.monotonic)."""

    streamed: bool
    status: int
    body: dict[str, Any] | None
    events: list[str]
    at: float

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The error objects sent in a stream's events."""
        payloads = [json.loads(e) for e in self.events if e != "[DONE]"]
        return [p["error"] for p in payloads if "error" in p]


def _body(index: int, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, dict[str, Any]]:
    common = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if index % 2:
        messages = [{"role": "user", "content": f"chaos request {index}"}]
        return "/v1/chat/completions", common | {"messages": messages}
    return "/v1/completions", common | {"prompt": f"chaos request {index}"}


async def _ask(http: httpx.AsyncClient, index: int, stream: bool, **options: Any) -> Answer:
    path, body = _body(index, stream, **options)
    if not stream:
        response = await http.post(path, json=body)
        return Answer(False, response.status_code, response.json(), [], time.monotonic())
    events: list[str] = []
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Answer(True, response.status_code, response.json(), [], time.monotonic())
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return Answer(True, response.status_code, None, events, time.monotonic())


async def _ask_all(url: str, count: int, **options: Any) -> list[Answer]:
    """`count` requests at once, every other one streamed."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await asyncio.gather(*(_ask(http, i, i % 2 == 0, **options) for i in range(count)))


def _gauges(url: str) -> dict[str, float]:
    """/metrics' vLLM-named gauges (one model: labels dropped)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:") and family.type == "gauge"
    }


def _wait_idle(url: str, llm: AsyncLLM, timeout: float = 10.0) -> dict[str, float]:
    """Wait until /metrics shows no request and no KV block in use; the last gauges."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = _gauges(url)
        idle = (
            gauges["vllm:num_requests_running"] == 0
            and gauges["vllm:num_requests_waiting"] == 0
            and gauges["vllm:kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return gauges
        time.sleep(0.05)


class _Fault:
    """Raises once, once armed, at the `AFTER`th step that decodes all IN_FLIGHT requests
    (so that every stream has sent tokens by then)."""

    AFTER = 4

    def __init__(self, message: str) -> None:
        self.message = message
        self.armed = threading.Event()
        self.seen = 0
        self.raised = 0
        self.struck_at = 0.0

    def check(self, chunks: list[ScheduledSequence]) -> None:
        if not self.armed.is_set() or len(chunks) != IN_FLIGHT:
            return
        if any(chunk.num_new_tokens != 1 for chunk in chunks):
            return
        self.seen += 1
        if self.seen < self.AFTER:
            return
        self.armed.clear()
        self.raised += 1
        self.struck_at = time.monotonic()
        raise RuntimeError(self.message)


@contextmanager
def _served(model: Path) -> Iterator[tuple[str, AsyncLLM]]:
    """A live in-process server on the tiny Llama (served as 'tiny') and its engine."""
    built: list[AsyncLLM] = []

    def factory(config: EngineConfig) -> AsyncLLM:
        built.append(AsyncLLM.from_config(config))
        return built[0]

    config = tiny_config(model, served_model_name="tiny", max_num_seqs=IN_FLIGHT)
    with live_server(config, llm_factory=factory) as url:
        yield url, built[0]


def _check_failed(answers: list[Answer], struck_at: float, words: str) -> None:
    """Every answer is the failure: a 500 in OpenAI's format, or a stream that ends with
    one error event and then [DONE]; each within ANSWER_WITHIN of the fault."""
    assert len(answers) == IN_FLIGHT
    slowest = max(answer.at for answer in answers) - struck_at
    print(f"{len(answers)} requests in flight all failed within {slowest:.3f} s of the fault")
    for answer in answers:
        assert answer.at - struck_at < ANSWER_WITHIN, "a request in flight hung"
        if answer.streamed:
            assert answer.status == 200
            assert answer.events[-1] == "[DONE]", answer.events[-3:]
            assert len(answer.errors) == 1, answer.events[-3:]
            error = answer.errors[0]
            # The error event comes last, after the chunks sent before the fault.
            assert json.loads(answer.events[-2]) == {"error": error}
        else:
            assert answer.status == 500, answer.body
            assert answer.body is not None
            error = answer.body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "server_error"
        assert words in error["message"], error["message"]


def test_a_step_that_raises_fails_its_batch_and_the_server_goes_on(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with _served(tiny_model_paths["llama"]) as (url, llm):
        runner = llm.engine.runner
        execute = runner.execute
        fault = _Fault("simulated device failure in a step")

        def flaky(chunks: list[ScheduledSequence]) -> Any:
            fault.check(chunks)
            return execute(chunks)

        monkeypatch.setattr(runner, "execute", flaky)
        fault.armed.set()
        answers = asyncio.run(_ask_all(url, IN_FLIGHT))
        assert fault.raised == 1
        _check_failed(answers, fault.struck_at, "simulated device failure in a step")
        # Every stream had sent tokens before the fault struck.
        assert all(len(a.events) > 2 for a in answers if a.streamed)
        gauges = _wait_idle(url, llm)
        assert gauges["vllm:kv_cache_usage_perc"] == 0, gauges
        assert gauges["vllm:num_requests_running"] == 0, gauges
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.stats().used_kv_blocks == 0
        # The server goes on: the next requests, streamed and whole, all complete.
        assert httpx.get(f"{url}/health").status_code == 200
        again = asyncio.run(_ask_all(url, IN_FLIGHT, max_tokens=16))
        for answer in again:
            assert answer.status == 200
            if answer.streamed:
                assert answer.events[-1] == "[DONE]" and not answer.errors
            else:
                assert answer.body is not None
                assert answer.body["choices"][0]["finish_reason"] == "length"
                assert answer.body["usage"]["completion_tokens"] == 16
        assert _wait_idle(url, llm)["vllm:kv_cache_usage_perc"] == 0


def test_a_dead_engine_loop_fails_every_request_and_health_says_so(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with _served(tiny_model_paths["llama"]) as (url, llm):
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule
        fault = _Fault("simulated scheduler failure")

        def broken(*args: Any) -> Any:
            # Outside the step's guard: the engine loop itself dies.
            batch = schedule(*args)
            fault.check(batch.scheduled)
            return batch

        monkeypatch.setattr(scheduler, "schedule", broken)
        fault.armed.set()
        answers = asyncio.run(_ask_all(url, IN_FLIGHT))
        assert fault.raised == 1
        _check_failed(answers, fault.struck_at, "simulated scheduler failure")
        assert not llm.is_healthy
        health = httpx.get(f"{url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "engine stopped"})
        # New requests are refused at once with a 503, streamed or not; none waits.
        started = time.monotonic()
        later = asyncio.run(_ask_all(url, 4, max_tokens=8))
        assert time.monotonic() - started < ANSWER_WITHIN
        for answer in later:
            assert answer.status == 503, answer
            assert answer.body is not None
            assert answer.body["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{url}/metrics").status_code == 200


# `pagedserve serve` with a scheduler that raises once a trigger file exists.
_SERVE_WITH_A_FAULT = textwrap.dedent(
    """
    import os, sys
    from scheduler import Scheduler

    schedule = Scheduler.schedule

    def broken(self, *args):
        if os.path.exists(sys.argv[1]):
            raise RuntimeError("simulated scheduler failure")
        return schedule(self, *args)

    Scheduler.schedule = broken
    from pagedserve.cli import main

    raise SystemExit(main(sys.argv[2:]))
    """
)


def test_serve_exits_when_its_engine_dies(tiny_model_paths: dict[str, Path], tmp_path: Path):
    """`pagedserve serve` as users run it: a dead engine fails the stream in flight, then
    the process exits with code 1 and says why, so that a supervisor restarts it."""
    port = free_port()
    trigger = tmp_path / "fail-now"
    command = [
        *(sys.executable, "-c", _SERVE_WITH_A_FAULT, str(trigger), "serve"),
        *("--model", str(tiny_model_paths["llama"]), "--dtype", "float32", "--device", "cpu"),
        *("--kv-cache-memory", "64MiB", "--max-model-len", "512"),
        *("--served-model-name", "tiny", "--port", str(port)),
    ]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        _, body = _body(0, stream=True)
        body["max_tokens"] = 500
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    trigger.touch()
                    struck_at = time.monotonic()
        answered = time.monotonic() - struck_at
        code = process.wait(timeout=ANSWER_WITHIN)
        exited = time.monotonic() - struck_at
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "simulated scheduler failure" in error["message"]
    assert code == 1, output
    assert "the engine loop died" in output
    assert "the engine died (RuntimeError: simulated scheduler failure)" in output
    assert "the server shuts down (exit code 1) since its engine died" in output
    print(f"stream failed {answered:.2f} s after the fault; the server exited after {exited:.2f} s")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.ConnectError:
        return False


def test_a_request_racing_the_engines_death_does_not_hang(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that saw the engine alive just before its loop died is refused, not
    left waiting for outputs that never come."""
    config = EngineConfig(
        model=str(tiny_model_paths["llama"]),
        dtype="float32",
        kv_cache_memory="16MiB",
        enforce_eager=True,
    )
    llm = AsyncLLM.from_config(config)

    def broken(*args: Any) -> Any:
        raise RuntimeError("simulated scheduler failure")

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken)
    params = SamplingParams(temperature=0, max_tokens=4)

    async def ask(request_id: str) -> None:
        request = await llm.process("hello", params)
        async for _ in llm.generate(request, request_id):
            pass

    async def run() -> None:
        with pytest.raises(EngineError, match="simulated scheduler failure"):
            await asyncio.wait_for(ask("kills-the-loop"), 10)
        # The health check a request makes before it registers ran while the loop lived.
        monkeypatch.setattr(AsyncLLM, "is_healthy", property(lambda self: True))
        with pytest.raises(EngineError, match="the engine is not running"):
            await asyncio.wait_for(ask("just-too-late"), 10)
        await llm.shutdown()

    asyncio.run(run())
