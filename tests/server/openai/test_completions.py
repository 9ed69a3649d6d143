"""/v1/completions through the official openai client and curl, on the tiny model."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import RAY_INGRESS, SERVER, client

pytestmark = pytest.mark.parametrize("tiny_server", [SERVER, RAY_INGRESS], indirect=True)


def test_plain_completion_has_openai_shape_and_usage(tiny_server: str) -> None:
    result = client(tiny_server).completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=7, temperature=0
    )
    assert result.object == "text_completion"
    assert result.model == "tiny"
    assert result.id.startswith("cmpl-")
    [choice] = result.choices
    assert choice.index == 0
    assert choice.finish_reason in ("stop", "length")
    assert result.usage.prompt_tokens > 0
    assert 0 < result.usage.completion_tokens <= 7
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_defaults_to_sixteen_tokens(tiny_server: str) -> None:
    result = client(tiny_server).completions.create(
        model="tiny", prompt="Paged attention", temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 16
    assert result.choices[0].finish_reason == "length"


def test_prompts_times_n_choices_are_indexed_prompt_major(tiny_server: str) -> None:
    prompts = ["The quick brown fox", "Continuous batching"]
    result = client(tiny_server).completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=3
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for prompt_index, prompt in enumerate(prompts):
        alone = client(tiny_server).completions.create(
            model="tiny", prompt=prompt, n=2, max_tokens=5, temperature=0.8, seed=3
        )
        got = [c.text for c in result.choices[2 * prompt_index : 2 * prompt_index + 2]]
        assert got == [c.text for c in alone.choices]


def test_token_id_prompts_match_text_prompts(tiny_server: str, tiny_model_paths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_paths["llama"])
    api = client(tiny_server)
    texts = ["Héllo wörld", "def main():"]
    by_text = api.completions.create(model="tiny", prompt=texts, max_tokens=6, temperature=0)
    ids = [tokenizer.encode(text) for text in texts]
    by_ids = api.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    one = api.completions.create(model="tiny", prompt=ids[0], max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert one.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)


def test_echo_prepends_the_prompt(tiny_server: str) -> None:
    api = client(tiny_server)
    kwargs = dict(model="tiny", prompt="Héllo wörld", max_tokens=6, temperature=0)
    plain = api.completions.create(**kwargs)
    echo = api.completions.create(**kwargs, echo=True)
    assert echo.choices[0].text == "Héllo wörld" + plain.choices[0].text


def test_seed_reproduces_sampled_text(tiny_server: str) -> None:
    api = client(tiny_server)
    runs = [
        api.completions.create(model="tiny", prompt="The quick", max_tokens=12, seed=seed)
        .choices[0]
        .text
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_string_cuts_the_text(tiny_server: str) -> None:
    api = client(tiny_server)
    free = api.completions.create(
        model="tiny",
        prompt="The quick",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = free.choices[0].text
    stop = text[4:6]
    assert stop.strip(), f"pick a stop string inside {text!r}"
    cut = api.completions.create(
        model="tiny", prompt="The quick", max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_legacy_logprobs(tiny_server: str) -> None:
    result = client(tiny_server).completions.create(
        model="tiny", prompt="The quick", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    # Greedy: the chosen token is the most likely one.
    assert logprobs.token_logprobs[0] == pytest.approx(max(logprobs.top_logprobs[0].values()))


def test_streaming_deltas_add_up_to_the_plain_text(tiny_server: str) -> None:
    api = client(tiny_server)
    kwargs = dict(model="tiny", prompt="Continuous batching", max_tokens=12, temperature=0)
    plain = api.completions.create(**kwargs)
    chunks = list(
        api.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert finishing[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_streaming_n2_with_echo(tiny_server: str) -> None:
    chunks = list(
        client(tiny_server).completions.create(
            model="tiny", prompt="Hi", n=2, max_tokens=4, seed=1, echo=True, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(text.startswith("Hi") and len(text) > 2 for text in texts.values())


def test_a_streamed_text_with_unicode_line_separators_reads_line_by_line(
    tiny_server: str,
) -> None:
    # httpx's `iter_lines`, like `str.splitlines`, breaks at U+0085, U+2028 and U+2029,
    # which JSON may leave raw; a model's text holds them now and then.
    prompt = "one\u2028two\u2029three\x85four"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "echo": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server}/v1/completions", json=body, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert text.startswith(prompt)


def test_curl_plain_and_streaming(tiny_server: str) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    plain = _curl(f"{tiny_server}/v1/completions", body)
    response = json.loads(plain)
    assert response["choices"][0]["text"]
    stream = _curl(f"{tiny_server}/v1/completions", {**body, "stream": True})
    events = [line.removeprefix("data: ") for line in stream.splitlines() if line]
    assert events[-1] == "[DONE]"
    deltas = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
    assert deltas == response["choices"][0]["text"]


def _curl(url: str, body: dict) -> str:
    command = ["curl", "-sS", "--fail-with-body", "-N", url, "-H", "Content-Type: application/json"]
    return subprocess.run(
        [*command, "-d", json.dumps(body)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
