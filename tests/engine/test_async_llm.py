"""AsyncLLM: concurrent streams, aborts that free blocks, and surviving a failed step."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import EngineError, ModelLoadError
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_paths: dict[str, Path]):
    config = EngineConfig(
        model=str(tiny_model_paths["qwen3"]),
        dtype="float32",
        kv_cache_memory="16MiB",
        enforce_eager=True,
    )
    engine = AsyncLLM.from_config(config)
    yield engine
    asyncio.run(engine.shutdown())


async def collect(llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str):
    """The streamed text and the whole output, accumulated from the engine's deltas."""
    request = await llm.process(prompt, params)
    deltas: list[str] = []
    whole = None
    async for output in llm.generate(request, request_id):
        deltas.append(output.outputs[0].text)
        if whole is None:
            whole = output
        else:
            whole.add(output)
    assert whole is not None and whole.finished
    return "".join(deltas), whole


async def wait_for_idle(llm: AsyncLLM) -> None:
    for _ in range(200):
        stats = llm.stats()
        if stats.num_running == stats.num_waiting == stats.used_kv_blocks == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {llm.stats()}")


def test_concurrent_streams_equal_sequential_results(llm: AsyncLLM):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [f"prompt number {i} " * (i + 1) for i in range(8)]

    async def run():
        alone = [await collect(llm, p, params, f"seq-{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(
            *(collect(llm, p, params, f"par-{i}") for i, p in enumerate(prompts))
        )
        return alone, together

    alone, together = asyncio.run(run())
    for (text_a, out_a), (text_b, out_b) in zip(alone, together, strict=True):
        assert text_a == out_a.outputs[0].text == text_b == out_b.outputs[0].text
        assert out_a.outputs[0].token_ids == out_b.outputs[0].token_ids


def test_leaving_a_stream_early_aborts_and_frees_blocks(llm: AsyncLLM):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        seen = 0
        before = llm.stats().generation_tokens_total
        request = await llm.process("long " * 50, params)
        async for _ in llm.generate(request, "early-exit"):
            seen += 1
            if seen == 3:
                break
        await wait_for_idle(llm)
        return llm.stats().generation_tokens_total - before

    # Aborted, the request stopped within a few steps of the client's leaving: far from the
    # 400 tokens it would have run to (which the tiny model makes within the idle wait).
    assert asyncio.run(run()) < 50


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
):
    runner = llm.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device failure")
        return original(chunks)

    monkeypatch.setattr(runner, "execute", flaky)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        with pytest.raises(EngineError, match="simulated device failure"):
            await collect(llm, "doomed", params, "fails")
        await wait_for_idle(llm)
        text, _ = await collect(llm, "fine", params, "works")
        return text

    assert asyncio.run(run())
    assert llm.is_healthy


def test_invalid_input_raises_before_queueing(llm: AsyncLLM):
    async def run():
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(llm, "x", SamplingParams(max_tokens=10**7), "too-long")
        with pytest.raises(ValueError, match="empty"):
            await collect(llm, "", SamplingParams(), "empty")

    asyncio.run(run())
    assert llm.stats().num_waiting == 0


def test_the_engine_loads_apart_and_steps_on_the_torch_thread(
    tiny_model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    """The load's thread ends with the load (its OpenMP workers with it) and every step
    runs on the process's torch thread: a second thread's pool slows every step."""
    built_on: list[threading.Thread] = []
    stepped_on: set[str] = set()
    build, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self: LLMEngine, config: EngineConfig) -> None:
        built_on.append(threading.current_thread())
        build(self, config)

    def recording_step(self: LLMEngine) -> list:
        stepped_on.add(threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    config = EngineConfig(
        model=str(tiny_model_paths["llama"]), kv_cache_memory="16MiB", enforce_eager=True
    )
    llm = AsyncLLM.from_config(config)
    try:
        asyncio.run(collect(llm, "hello", SamplingParams(max_tokens=3), "r"))
        assert [thread.name for thread in built_on] == ["pagedserve-load"]
        assert not built_on[0].is_alive()
        assert stepped_on == {"pagedserve-torch"}
    finally:
        asyncio.run(llm.shutdown())


def test_a_load_failure_is_raised_to_the_caller(tmp_path: Path):
    def engine_threads() -> int:
        return sum(t.name == "pagedserve-engine" for t in threading.enumerate())

    before = engine_threads()
    with pytest.raises(ModelLoadError):
        AsyncLLM.from_config(EngineConfig(model=str(tmp_path / "no-such-model")))
    assert engine_threads() == before


def test_a_prompt_is_tokenized_once_on_the_intake_thread(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
):
    calls: list[str] = []
    tokenizer = llm._processor.tokenizer
    encode = tokenizer.encode

    def recording_encode(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    text, _ = asyncio.run(collect(llm, "tokenized once", params, "once"))
    assert text
    assert len(calls) == 1 and calls[0].startswith("pagedserve-intake")
