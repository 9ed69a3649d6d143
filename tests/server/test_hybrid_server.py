"""A hybrid model (a tiny Qwen3.5: Gated DeltaNet beside gated attention) over HTTP with
the official client, served as `make serve` serves (compiled, its C++ kernels): a second
request on the same system prompt reports the prompt it resumed in `cached_tokens`, and
Qwen3.5's own chat template thinks or not as `chat_template_kwargs` asks, the reasoning
apart from the answer, streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.reasoning import END, START
from tests.server.conftest import client, live_server, tiny_config
from tests.support.architectures import HYBRID, build

pytestmark = pytest.mark.slow

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_5_chat_template.jinja").read_text()
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly. " * 24}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = build(tmp_path_factory.mktemp("qwen3_5") / "model", *HYBRID["qwen3_5"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([START, END])
    tokenizer.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = tiny_config(folder, served_model_name="qwen3.5", enforce_eager=None,
                         max_model_len=2048)  # fmt: skip
    with live_server(config) as served:
        yield served


def test_a_second_request_on_a_system_prompt_resumes_it(url: str) -> None:
    openai = client(url)

    def ask(question: str):
        messages = [SYSTEM, {"role": "user", "content": question}]
        return openai.chat.completions.create(
            model="qwen3.5", messages=messages, max_tokens=4, temperature=0, extra_body=NO_THINKING
        )

    first = ask("What is the capital of France?")
    second = ask("Name a prime number.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Computed: the new question, the template's turn markers and at most one block.
    assert second.usage.prompt_tokens - cached <= 48
    assert cached > 0


def test_qwen3_5_thinks_unless_asked_not_to(url: str) -> None:
    openai = client(url)
    messages = [{"role": "user", "content": "Hello"}]
    thinking = (
        openai.chat.completions.create(
            model="qwen3.5", messages=messages, max_tokens=6, temperature=0
        )
        .choices[0]
        .message
    )
    assert thinking.model_extra["reasoning_content"] and not thinking.content
    answer = (
        openai.chat.completions.create(
            model="qwen3.5", messages=messages, max_tokens=6, temperature=0, extra_body=NO_THINKING
        )
        .choices[0]
        .message
    )
    assert answer.content and answer.model_extra.get("reasoning_content") is None
    stream = openai.chat.completions.create(
        model="qwen3.5", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    reasoning = "".join(
        (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for chunk in stream
        if chunk.choices
    )
    assert reasoning == thinking.model_extra["reasoning_content"]
