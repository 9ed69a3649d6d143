"""Reasoning told from the answer: the splitter (streamed as whole), the parser a chat
template picks, and a live tiny Qwen3 with Qwen3's own chat template, whose reasoning
comes back as `reasoning_content` on chat completions (streamed and not) and as thinking
blocks on /v1/messages. The random weights are held to a reply that thinks by a grammar:
structure is judged, not wisdom."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.reasoning import END, START, ReasoningStream, ReasoningSyntax, split_reasoning
from tests.server.conftest import QWEN3_TEMPLATE, client, live_server, tiny_config
from tests.support.tiny_models import CHAT_TEMPLATE

QWEN3 = ReasoningSyntax(always_open=False)
DEEPSEEK_R1 = ReasoningSyntax(always_open=True)

# text -> (reasoning, answer) under qwen3, and under deepseek_r1
SPLITS = {
    "<think>\nI ponder.\n</think>\n\nBlue.": (("I ponder.", "Blue."), ("I ponder.", "Blue.")),
    "Blue.": ((None, "Blue."), ("Blue.", "")),
    "Blue <think>x</think>": ((None, "Blue <think>x</think>"), ("Blue <think>x", "")),
    "  <think> cut short": (("cut short", ""), ("cut short", "")),
    "<think>\n\n</think>\n\nBlue.": ((None, "Blue."), (None, "Blue.")),
    "I ponder.</think>Blue.": ((None, "I ponder.</think>Blue."), ("I ponder.", "Blue.")),
    "<thi": ((None, "<thi"), ("<thi", "")),
    "": ((None, ""), (None, "")),
}


@pytest.mark.parametrize("text", SPLITS)
def test_split(text: str) -> None:
    qwen3, deepseek_r1 = SPLITS[text]
    assert split_reasoning(QWEN3, [], text) == qwen3
    assert split_reasoning(DEEPSEEK_R1, [], text) == deepseek_r1
    assert split_reasoning(None, [], text) == (None, text)


PIECES = st.lists(
    st.sampled_from([START, END, "<", "</th", "ink>", " ", "\n", "a", "b c", "é"]), max_size=12
)


@given(pieces=PIECES, cuts=st.lists(st.integers(0, 60), max_size=8), open_=st.booleans())
def test_streamed_pieces_split_as_the_whole(
    pieces: list[str], cuts: list[int], open_: bool
) -> None:
    text = "".join(pieces)
    whole = split_reasoning(ReasoningSyntax(open_), [], text)
    stream = ReasoningStream(open_)
    reasoning = answer = ""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    for start, end in itertools.pairwise(bounds):
        more_reasoning, more_answer = stream.feed(text[start:end])
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    last_reasoning, last_answer = stream.finish()
    assert ((reasoning + last_reasoning) or None, answer + last_answer) == whole


def test_the_parser_a_template_picks() -> None:
    tokens = {START: 7, END: 8}
    auto = ReasoningSyntax.of("auto", QWEN3_TEMPLATE, tokens)
    assert auto == ReasoningSyntax(always_open=False, start_id=7, end_id=8)
    assert ReasoningSyntax.of("auto", CHAT_TEMPLATE, tokens) is None
    assert ReasoningSyntax.of("none", QWEN3_TEMPLATE, tokens) is None
    assert ReasoningSyntax.of("deepseek_r1", CHAT_TEMPLATE, {}) == DEEPSEEK_R1
    # a prompt that opened the reasoning itself; one that closed it (thinking off)
    assert auto.opens_in_reasoning([1, 2, 7, 10])
    assert not auto.opens_in_reasoning([1, 7, 10, 8, 10])
    assert not auto.opens_in_reasoning([7, 1, 2, 3, 4])


@pytest.fixture(scope="module")
def server(qwen3_model: Path) -> Iterator[str]:
    """Served with the default reasoning_parser, `auto`: the template's `<think>` picks qwen3."""
    config = tiny_config(qwen3_model, served_model_name="tiny", max_model_len=2048)
    with live_server(config) as url:
        yield url


ASK = [{"role": "user", "content": "Name a colour."}]
SEED = 1


@pytest.fixture(scope="module")
def thinks(qwen3_model: Path) -> dict[str, Any]:
    """Sampling that makes the random weights think, briefly: `<think>` first (where a
    reply may open with it), and `</think>` likelier than any other token. A trained model
    stands in for these biases; structure is judged, not wisdom."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model)
    start, end = tokenizer.convert_tokens_to_ids([START, END])
    return {"temperature": 1, "seed": SEED, "logit_bias": {str(start): 100, str(end): 4}}


def test_chat_reasoning_content(server: str, thinks: dict[str, Any]) -> None:
    api = client(server)
    # The answer's grammar holds the answer only: the thinking before it is free.
    extra = {**thinks, "guided_regex": "[A-Z][a-z]{3,8}"}
    kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, max_tokens=40, extra_body=extra)
    message = api.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and reasoning == reasoning.strip() and START not in reasoning
    assert message.content and re.fullmatch("[A-Z][a-z]{3,8}", message.content)
    chunks = list(api.chat.completions.create(**kwargs, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    streamed = [(d.model_extra or {}).get("reasoning_content") or "" for d in deltas]
    assert "".join(streamed) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    # the reasoning streams before the answer, separately
    last_reasoning = max(i for i, text in enumerate(streamed) if text)
    first_answer = min(i for i, d in enumerate(deltas) if d.content)
    assert last_reasoning <= first_answer
    # a reply without reasoning has no reasoning_content
    plain = api.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, temperature=0)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


PAINT = {
    "type": "function",
    "function": {
        "name": "paint",
        "parameters": {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "blue"]}},
            "required": ["colour"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_follows_the_thinking(
    server: str, thinks: dict[str, Any], choice: str
) -> None:
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": "paint"}}
    )
    reply = client(server).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=80, tools=[PAINT], tool_choice=tool_choice,
        parallel_tool_calls=False, extra_body=thinks,
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"]
    [call] = message.tool_calls or []
    assert call.function.name == "paint"
    assert json.loads(call.function.arguments)["colour"] in ("red", "blue")
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None


@pytest.fixture(scope="module")
def opening_server(qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same model under Qwen3's template with the assistant's turn opened in
    `<think>` (as Qwen3's thinking-only models' templates do): every reply begins in its
    reasoning, and the random weights never close it."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-opening")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model)
    opener = "{{- '<|im_start|>assistant\\n' }}"
    assert opener in QWEN3_TEMPLATE
    tokenizer.chat_template = QWEN3_TEMPLATE.replace(
        opener, opener.replace("\\n'", "\\n<think>\\n'")
    )
    tokenizer.save_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(qwen3_model).save_pretrained(folder)
    with live_server(tiny_config(folder, served_model_name="tiny", max_model_len=2048)) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_blocks(opening_server: str, stream: bool) -> None:
    api = anthropic.Anthropic(base_url=opening_server, api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0})

    def reply(messages: list[Any] = ASK, **more: Any) -> anthropic.types.Message:
        if not stream:
            return api.messages.create(messages=messages, **kwargs, **more)
        with api.messages.stream(messages=messages, **kwargs, **more) as events:
            return events.get_final_message()

    chat = client(opening_server).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=12, temperature=0
    )
    reasoning = chat.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and chat.choices[0].message.content == ""
    shown = reply()
    [thinking] = shown.content
    assert (thinking.type, thinking.thinking) == ("thinking", reasoning)
    assert shown.stop_reason == "max_tokens"
    enabled = reply(thinking={"type": "enabled", "budget_tokens": 8})
    assert enabled.content == shown.content
    omitted = reply(thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, b.thinking) for b in omitted.content] == [("thinking", "")]
    # disabled: the template's `enable_thinking` is false, and it closes the thinking in
    # the prompt, so the whole reply is the answer
    assert [block.type for block in reply(thinking={"type": "disabled"}).content] == ["text"]
    # earlier thinking passed back is accepted (and left out of the prompt, as the
    # template leaves out reasoning before the last question)
    text = {"type": "text", "text": "Blue."}
    turn = {"role": "assistant", "content": [thinking.model_dump(), text]}
    again = [*ASK, turn, {"role": "user", "content": "Another."}]
    assert [block.type for block in reply(again).content] == ["thinking"]
    without = [*ASK, {"role": "assistant", "content": [text]}, again[-1]]
    counted = [api.messages.count_tokens(model="tiny", messages=m) for m in (again, without)]
    assert counted[0].input_tokens == counted[1].input_tokens


COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}, "shade": {"enum": [1, 2, 3]}},
    "required": ["colour", "shade"],
    "additionalProperties": False,
}


def check_colour(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"colour", "shade"} and value["colour"] in ("red", "blue")
    assert isinstance(value["shade"], int)


def test_a_json_schema_holds_the_answer_after_the_thinking(
    opening_server: str, thinks: dict[str, Any]
) -> None:
    # The prompt opens the thinking: the reply thinks first, then answers in JSON.
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}}
    reply = client(opening_server).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=80, response_format=fmt, extra_body=thinks
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert message.content is not None
    check_colour(message.content)


def test_thinking_off_closes_it_in_the_prompt(
    server: str, thinks: dict[str, Any], qwen3_model: Path
) -> None:
    api = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}}

    def chat(**extra: Any) -> Any:
        body = {**thinks, **extra}
        return api.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=80, response_format=fmt, extra_body=body
        )

    on, off = chat(), chat(chat_template_kwargs={"enable_thinking": False})
    assert on.choices[0].message.model_extra["reasoning_content"]
    # Off, the template wrote `<think>\n\n</think>\n\n` itself: the reply is the answer at
    # once, the bias on `<think>` notwithstanding.
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    check_colour(off.choices[0].message.content)
    closed = len(AutoTokenizer.from_pretrained(qwen3_model).encode("<think>\n\n</think>\n\n"))
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + closed
    # Anthropic's thinking disabled is the same variable, in count_tokens too.
    messages = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0).messages
    counts = [
        messages.count_tokens(model="tiny", messages=ASK, **more).input_tokens
        for more in ({}, {"thinking": {"type": "disabled"}})
    ]
    assert counts == [on.usage.prompt_tokens, off.usage.prompt_tokens]
    # /tokenize renders it as chat does
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(f"{server}/tokenize", json=body).json()["count"] == off.usage.prompt_tokens
    output = {"format": {"type": "json_schema", "schema": COLOUR}}
    disabled = messages.create(
        model="tiny", max_tokens=80, messages=ASK, thinking={"type": "disabled"},
        extra_body={"temperature": 0, "output_config": output},
    )  # fmt: skip
    [text] = disabled.content
    check_colour(text.text)


def test_template_arguments_the_server_sets_are_refused(server: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )
    assert refused.value.body["param"] == "chat_template_kwargs.tokenize"  # type: ignore[index]
