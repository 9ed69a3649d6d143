"""/v1/chat/completions through the official openai client and curl, on the tiny model."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.server.conftest import ASYNC_SCHEDULING, RAY_INGRESS, SYNC, client

pytestmark = pytest.mark.parametrize(
    "tiny_server", [SYNC, ASYNC_SCHEDULING, RAY_INGRESS], indirect=True
)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def test_plain_chat_has_openai_shape_and_usage(tiny_server: str) -> None:
    result = client(tiny_server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    [choice] = result.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < result.usage.completion_tokens <= 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_prompt_is_the_chat_template_with_the_assistant_turn_open(
    tiny_server: str, tiny_model_paths
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_paths["llama"])
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    api = client(tiny_server)
    chat = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    completion = api.completions.create(model="tiny", prompt=rendered, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens


def test_text_parts_content_equals_string_content(tiny_server: str) -> None:
    api = client(tiny_server)
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    as_parts = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0
    )
    as_string = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Name a\ncolour."}],
        max_tokens=6,
        temperature=0,
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_max_completion_tokens_wins_over_max_tokens(tiny_server: str) -> None:
    result = client(tiny_server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=9,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert result.usage.completion_tokens == 3


def test_n2_seeded_samples_are_reproducible(tiny_server: str) -> None:
    api = client(tiny_server)

    def run(seed: int) -> list[str]:
        result = api.chat.completions.create(
            model="tiny", messages=MESSAGES, n=2, max_tokens=8, seed=seed
        )
        assert [c.index for c in result.choices] == [0, 1]
        return [c.message.content for c in result.choices]

    first = run(11)
    assert first == run(11)
    assert first[0] != first[1]


def test_chat_logprobs(tiny_server: str) -> None:
    result = client(tiny_server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_stream_order_role_content_finish_usage_done(tiny_server: str) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{tiny_server}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] > 0
    for index in (0, 1):
        own = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == index]
        assert own[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(c["delta"]) == {"content"} for c in own[1:-1])
        assert own[-1]["delta"] == {}
        assert own[-1]["finish_reason"] in ("stop", "length")
        assert all(c["finish_reason"] is None for c in own[:-1])


def test_streamed_text_equals_plain_text(tiny_server: str) -> None:
    api = client(tiny_server)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True)
    plain = api.chat.completions.create(**kwargs)
    chunks = list(api.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    streamed_logprobs = [
        e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed_logprobs] == [
        e.token for e in plain.choices[0].logprobs.content
    ]


def test_stop_ends_the_chat_answer(tiny_server: str) -> None:
    api = client(tiny_server)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    free = api.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    text = free.choices[0].message.content
    stop = text[3:5]
    cut = api.chat.completions.create(**kwargs, stop=stop)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_curl_chat(tiny_server: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    command = ["curl", "-sS", "--fail-with-body", f"{tiny_server}/v1/chat/completions"]
    output = subprocess.run(
        [*command, "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(output)["choices"][0]["message"]["role"] == "assistant"
