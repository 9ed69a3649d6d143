"""logit_bias on both endpoints, /tokenize and /detokenize, against a live server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.server.conftest import client

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
FORCED = 300  # a token id of the tiny vocabulary (384) that greedy decoding never picks here


@pytest.fixture(scope="module")
def tokenizer(tiny_model_paths: dict[str, Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_paths["llama"])


def only_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """The id of a token given by its text (as logprobs name it)."""
    [token_id] = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def test_completion_logit_bias_bans_and_forces(
    tiny_server: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    api = client(tiny_server)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2)
    plain = api.completions.create(**kwargs).choices[0]
    top, runner_up = plain.logprobs.top_logprobs[0]
    assert plain.text == top
    ban = {str(only_id(tokenizer, top)): -100}
    banned = api.completions.create(**kwargs, logit_bias=ban).choices[0]
    assert banned.text == runner_up
    # Logprobs stay those of the model: the bias changes the choice, not the numbers.
    assert banned.logprobs.token_logprobs[0] == pytest.approx(
        plain.logprobs.top_logprobs[0][runner_up]
    )
    assert tokenizer.decode([FORCED]) != top
    forced = api.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(FORCED): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == tokenizer.decode([FORCED] * 4)


def test_chat_logit_bias_bans_and_forces(
    tiny_server: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    api = client(tiny_server)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    plain = api.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2).choices[0]
    top, runner_up = (entry.token for entry in plain.logprobs.content[0].top_logprobs)
    ban = {str(only_id(tokenizer, top)): -100}
    banned = api.chat.completions.create(**kwargs, logit_bias=ban)
    assert banned.choices[0].message.content == runner_up
    forced = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        logit_bias={str(FORCED): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].message.content == tokenizer.decode([FORCED] * 3)


def test_logit_bias_reaches_streams_and_samples(
    tiny_server: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    chunks = client(tiny_server).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3,
        n=2,
        seed=5,
        logit_bias={str(FORCED): 100},
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: tokenizer.decode([FORCED] * 3), 1: tokenizer.decode([FORCED] * 3)}


def tokenize(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/tokenize", json=body)


def test_tokenize_a_prompt_as_completions_count_it(
    tiny_server: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    response = tokenize(tiny_server, model="tiny", prompt=PROMPT)
    assert response.status_code == 200, response.text
    ids = tokenizer.encode(PROMPT)
    assert response.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    usage = client(tiny_server).completions.create(model="tiny", prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == len(ids)
    with_strs = tokenize(
        tiny_server, prompt=PROMPT, add_special_tokens=False, return_token_strs=True
    )
    assert with_strs.json()["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert with_strs.json()["token_strs"] == tokenizer.convert_ids_to_tokens(ids)


def test_tokenize_messages_as_chat_renders_them(
    tiny_server: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    opened = tokenize(tiny_server, messages=MESSAGES).json()
    expected = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert opened["tokens"] == list(expected)
    usage = (
        client(tiny_server)
        .chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
        .usage
    )
    assert usage.prompt_tokens == opened["count"]
    closed = tokenize(tiny_server, messages=MESSAGES, add_generation_prompt=False).json()
    assert closed["tokens"] == list(
        tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=False
        )
    )
    assert closed["count"] < opened["count"]


def test_detokenize_inverts_tokenize(tiny_server: str) -> None:
    ids = tokenize(tiny_server, prompt="Héllo wörld").json()["tokens"]
    response = httpx.post(f"{tiny_server}/detokenize", json={"model": "tiny", "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": "Héllo wörld"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("detokenize", {"tokens": [1, 384]}, 400, "tokens"),
        ("detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
        ("detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
        ("tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
        ("tokenize", {}, 400, None),
        ("tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("tokenize", {"prompt": "a", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens"),
        ("tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ],
)
def test_bad_tokenize_requests(
    tiny_server: str, path: str, body: dict, status: int, param: str | None
) -> None:
    response = httpx.post(f"{tiny_server}/{path}", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
