"""`prompt_logprobs` (vLLM's shape) on completions and chat, and `echo` with `logprobs`,
through the real `openai` client: values equal transformers' fp32 log_softmax."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.config import DEFAULT_PRESET
from tests.server.conftest import client, live_server, tiny_config

PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."


@pytest.fixture(scope="module")
def expected(tiny_model_paths: dict[str, Path]) -> tuple[list[int], torch.Tensor]:
    """The prompt's token ids and log_softmax of the logits at each position (fp32)."""
    path = tiny_model_paths["llama"]
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def chunking_server(tiny_model_paths: dict[str, Path]) -> Iterator[str]:
    """Eager, with prompts chunked in 8-token steps and a prefix cache."""
    config = tiny_config(tiny_model_paths["llama"], served_model_name="tiny",
                         max_num_batched_tokens=8)  # fmt: skip
    with live_server(config) as url:
        yield url


def check_vllm_shape(prompt_logprobs, expected, count: int) -> None:
    ids, logprobs = expected
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:], start=1):
        row = logprobs[i - 1]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(count).indices.tolist()
        assert set(entry) == {str(t) for t in [ids[i], *top]}
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


def test_completions_prompt_logprobs(chunking_server, expected):
    api = client(chunking_server)
    api.completions.create(model="tiny", prompt=PROMPT[:40], max_tokens=1)  # caches a prefix
    response = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    check_vllm_shape(response.choices[0].prompt_logprobs, expected, 2)
    plain = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].text == response.choices[0].text
    assert plain.choices[0].prompt_logprobs is None


def test_chat_prompt_logprobs(chunking_server, tiny_model_paths):
    api = client(chunking_server)
    messages = [{"role": "user", "content": "Say something about foxes."}]
    response = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    entries = response.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == response.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in entries[1:])  # the prompt token alone
    assert all(
        e["rank"] >= 1 and e["logprob"] <= 0 for entry in entries[1:] for e in entry.values()
    )


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_with_logprobs(chunking_server, expected, max_tokens):
    ids, logprobs = expected
    response = client(chunking_server).completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
    )
    choice = response.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(logprobs[i - 1][ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(math.isfinite(v) for v in lp.token_logprobs[1:])
    assert response.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_values_are_400s_naming_the_field(chunking_server, body, param):
    api = client(chunking_server)
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 2, **body})
    assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}],
            extra_body={"prompt_logprobs": 99},
        )  # fmt: skip


@pytest.mark.slow
def test_the_default_path_compiled_with_drafts(tiny_model_paths, expected):
    """enforce_eager unset (the compiled forward) and the shipped n-gram drafts."""
    config = tiny_config(
        tiny_model_paths["llama"], served_model_name="tiny", enforce_eager=None,
        speculative_config=DEFAULT_PRESET["speculative_config"],
    )  # fmt: skip
    with live_server(config) as url:
        api = client(url)
        response = api.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True, logprobs=1,
            extra_body={"prompt_logprobs": 3},
        )  # fmt: skip
    check_vllm_shape(response.choices[0].prompt_logprobs, expected, 3)
    ids, logprobs = expected
    token_logprobs = response.choices[0].logprobs.token_logprobs[1 : len(ids)]
    assert token_logprobs == pytest.approx(
        [logprobs[i - 1][ids[i]].item() for i in range(1, len(ids))], abs=1e-4
    )
