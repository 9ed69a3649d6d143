"""Async scheduling (CUDA's default, run here on the CPU): each step launches the next
batch before it makes its own text, and nothing a request gets changes for it.

What only this mode does is tested here: the launch comes before the text, a row whose
sequence a stop string or an abort finished while its step was in flight is dropped
unsampled, and no KV block leaks. The offline API's tests (`test_llm.py`) and the greedy
equivalence tests run in this mode too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.outputs import RequestOutput
from engine.request.state import SampleState


def make_llm(path: Path, **settings) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory="16MiB", **settings)


@pytest.fixture(scope="module")
def engines(tiny_model_paths: dict[str, Path]) -> tuple[LLM, LLM]:
    path = tiny_model_paths["llama"]
    return make_llm(path, async_scheduling=False), make_llm(path, async_scheduling=True)


def run(llm: LLM, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, list]:
    """Step the engine until done; each request's outputs (text, tokens, finish, stop
    reason, logprob ids) in order, and no block left held."""
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, engine.processor.from_prompt(prompt, params))
    results: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id].append(summary(output))
    assert engine.stats().used_kv_blocks == 0
    return results


def summary(output: RequestOutput) -> list:
    return [
        (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
         [entry.token_id for entry in c.logprobs or []])
        for c in output.outputs
    ]  # fmt: skip


def test_auto_is_on_cuda_only_and_refused_with_speculation(tiny_model_paths):
    path = tiny_model_paths["llama"]
    engine = make_llm(path).engine
    assert engine.async_scheduling == (engine.device.type == "cuda")
    with pytest.raises(ConfigError, match="speculative"):
        make_llm(
            path, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )  # fmt: skip


def test_outputs_step_by_step_are_those_of_the_synchronous_engine(engines):
    """Stop strings (some hit while the sequence's next row is in flight), stop token ids,
    n > 1 with seeds, logprobs, prompt logprobs, penalties and lengths: every output of
    every step is the same, in the same step."""
    sync, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = sync.generate("Paged attention", greedy, use_tqdm=False)[0].outputs[0]
    requests = {
        "stop": ("Paged attention", SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[text.text[6:9]])),
        "stop-kept": ("Paged attention", SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[text.text[3:5]],
            include_stop_str_in_output=True)),
        "stop-id": ("Paged attention", SamplingParams(
            temperature=0, max_tokens=24, stop_token_ids=[text.token_ids[4]])),
        "seeded": ("Continuous batching", SamplingParams(
            temperature=1.0, max_tokens=9, seed=3, n=2, ignore_eos=True, logprobs=2)),
        "penalised": ("KV cache", SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
            frequency_penalty=0.5, prompt_logprobs=1)),
        "one": ("x", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    }  # fmt: skip
    expected = run(sync, requests)
    assert expected["stop"][-1][0][3:5] == ("stop", text.text[6:9])
    assert run(pipelined, requests) == expected


def test_the_next_launch_comes_before_this_steps_text(engines, monkeypatch):
    _, pipelined = engines
    engine = pipelined.engine
    events: list[str] = []
    execute, on_text = engine.runner.execute, SampleState.on_text
    monkeypatch.setattr(
        engine.runner, "execute", lambda scheduled: events.append("launch") or execute(scheduled)
    )
    monkeypatch.setattr(
        SampleState, "on_text", lambda self, ended: events.append("text") or on_text(self, ended)
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    run(pipelined, {"a": ("Paged attention", params)})
    # Prefill launched, then each step: the next launch, then the text of the token sampled.
    assert events == ["launch", "launch", "text", "launch", "text", "text"]


def test_a_row_in_flight_for_a_finished_sequence_is_dropped(engines, monkeypatch):
    """A stop string ends one sequence at its 6th token, while its next row is in flight;
    another request is aborted between steps while its 4th row is in flight. Neither row
    is sampled, the third request's tokens are those it gets alone, and every block comes
    back."""
    sync, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = sync.generate("Paged attention", greedy, use_tqdm=False)[0].outputs[0].token_ids
    decode = sync.get_tokenizer().decode
    before, through = decode(tokens[:5]), decode(tokens[:6])
    stop = through[len(before) :]
    assert stop and through.index(stop) == len(before), "the 6th token's text is new"
    alone = sync.generate("Continuous batching", greedy, use_tqdm=False)[0].outputs[0]
    engine = pipelined.engine
    sampled_rows: list[int] = []
    sample = engine.sampler.sample
    monkeypatch.setattr(
        engine.sampler, "sample",
        lambda logits, rows: sampled_rows.append(len(rows)) or sample(logits, rows),
    )  # fmt: skip
    stopping = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    for request_id, prompt, params in (
        ("stops", "Paged attention", stopping),
        ("aborted", "Prefix caching", greedy),
        ("kept", "Continuous batching", greedy),
    ):
        engine.add_request(request_id, engine.processor.from_prompt(prompt, params))
    outputs: dict[str, list[RequestOutput]] = {"stops": [], "aborted": [], "kept": []}
    while engine.has_unfinished_requests():
        if len(outputs["aborted"]) == 3 and "aborted" in engine._requests:
            engine.abort_request("aborted")
            assert engine._launched is not None
            in_flight = {item.seq.request_id for item in engine._launched.batch.scheduled}
            assert in_flight == {"stops", "aborted", "kept"}
        for output in engine.step():
            outputs[output.request_id].append(output)
    stops = outputs["stops"][-1].outputs[0]
    assert (stops.finish_reason, stops.stop_reason) == ("stop", stop)
    assert [t for o in outputs["stops"] for t in o.outputs[0].token_ids] == tokens[:6]
    kept = [t for o in outputs["kept"] for t in o.outputs[0].token_ids]
    assert kept == alone.token_ids
    # Three rows a step, then two after the abort (the aborted row in flight dropped),
    # then one after the stop: exactly the tokens handed out were sampled.
    assert sampled_rows == [3, 3, 3, 2, 2, 2] + [1] * 10
    assert engine.stats().used_kv_blocks == 0


def test_a_batch_left_in_flight_with_no_live_row_is_passed_over(engines):
    """The last request ends by a stop string while its next row is in flight: the engine
    has nothing unfinished but that batch, and the next call samples none of it."""
    sync, pipelined = engines
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = sync.generate("Paged attention", greedy, use_tqdm=False)[0].outputs[0].token_ids
    decode = sync.get_tokenizer().decode
    stop = decode(tokens[:3])[len(decode(tokens[:2])) :]
    stopping = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    first = pipelined.generate("Paged attention", stopping, use_tqdm=False)[0].outputs[0]
    assert (first.token_ids, first.stop_reason) == (tokens[:3], stop)
    engine = pipelined.engine
    assert not engine.has_unfinished_requests() and engine._launched is not None
    after = pipelined.generate("Paged attention", greedy, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == tokens
    assert engine.stats().used_kv_blocks == 0


def test_prompt_logprob_rows_of_an_aborted_chunk_in_flight_are_dropped(
    tiny_model_paths, engines, caplog
):
    """Two prompts with prompt logprobs prefill in 8-token chunks; one is aborted while its
    next chunk is in flight: no step fails, and the other's prompt logprobs are those the
    sync engine gives."""
    sync, _ = engines
    pipelined = make_llm(tiny_model_paths["llama"], async_scheduling=True, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    prompt = "The quick brown fox jumps over the lazy dog"
    expected = sync.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    engine = pipelined.engine
    engine.add_request("aborted", engine.processor.from_prompt("Paged attention " * 5, params))
    engine.add_request("kept", engine.processor.from_prompt(prompt, params))
    engine.step()  # the first chunks; the next are in flight
    assert engine._launched is not None and engine._launched.batch.num_prompt_logprob_rows
    engine.abort_request("aborted")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert not [r for r in caplog.records if "engine step failed" in r.getMessage()]
    (got,) = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert [e and (e.token_id, e.logprob) for e in got] == [
        e and (e.token_id, e.logprob) for e in expected
    ]
    assert engine.stats().used_kv_blocks == 0
