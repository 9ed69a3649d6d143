"""Reasoning on /v1/responses, through the official openai SDK against a live tiny Qwen3
with Qwen3's own chat template: the reply's reasoning as a `reasoning` item before the
message (streamed as `reasoning_text` events), counted in `reasoning_tokens`, sent back
and stored; tool calls and `text.format` hold the answer only; `reasoning.effort`
`none` turns the thinking off. The template opens `<think>` itself (as Qwen3's
thinking-only models' do) and the random weights write `</think>` where they would write
one ordinary token: structure is judged, not wisdom."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.errors import OpenAIError
from server.reasoning import END, ReasoningSyntax, reasoning_tokens
from server.responses.input import thinking_variables
from server.responses.protocol import ResponsesRequest
from tests.server.conftest import QWEN3_TEMPLATE, client, live_server, tiny_config
from tests.support.tiny_models import CHAT_TEMPLATE

ASK = "Name a colour."
TOKENS = 16
# The ordinary token whose greedy choices become `</think>`: the random weights' second
# token of most replies, so that replies think briefly, then answer.
CLOSER_AT = 2


COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def thinking_model(qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with the assistant's turn opened in `<think>`, whose `</think>` is
    scored a little above the token it greedily writes `CLOSER_AT`-th in reply to `ASK`;
    `{` above the one it writes after that `</think>`, and `<` above a carriage return
    (its choice there when offered a tool), so that a JSON answer or a forced call begins
    at once, not after the whitespace that the grammar allows after the thinking."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model)
    opener = "{{- '<|im_start|>assistant\\n' }}"
    tokenizer.chat_template = QWEN3_TEMPLATE.replace(
        opener, opener.replace("\\n'", "\\n<think>\\n'")
    )
    model = AutoModelForCausalLM.from_pretrained(qwen3_model)
    end = tokenizer.convert_tokens_to_ids(END)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        reply = model.generate(prompt(tokenizer), max_new_tokens=CLOSER_AT, do_sample=False)
        head[end] = head[int(reply[0, -1])] * 1.05
        reply[0, -1] = end
        after = model.generate(reply, max_new_tokens=1, do_sample=False)
        [brace] = tokenizer.encode("{")
        head[brace] = head[int(after[0, -1])] * 1.05
        [lt], [cr] = tokenizer.encode("<"), tokenizer.encode("\r")
        head[lt] = head[cr] * 1.05
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompt(tokenizer: Any) -> torch.Tensor:
    """The ids of the prompt of `ASK`."""
    ids = tokenizer.apply_chat_template(
        [user(ASK)], add_generation_prompt=True, return_tensors="pt"
    )
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


@pytest.fixture(scope="module")
def server(thinking_model: Path) -> Iterator[str]:
    config = tiny_config(thinking_model, served_model_name="tiny", max_model_len=2048)
    with live_server(config) as url:
        yield url


@pytest.fixture(scope="module")
def api(server: str) -> openai.OpenAI:
    return client(server)


def create(api: openai.OpenAI, **more: Any) -> Any:
    kwargs: dict[str, Any] = dict(model="tiny", max_output_tokens=TOKENS, temperature=0)
    return api.responses.create(**{"input": ASK, **kwargs, **more})


def test_reasoning_item_then_the_message(api: openai.OpenAI) -> None:
    response = create(api)
    reasoning, message = response.output
    assert isinstance(reasoning, openai.types.responses.ResponseReasoningItem)
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.status == "completed" and reasoning.encrypted_content is None
    [thought] = reasoning.content or []
    assert thought.type == "reasoning_text" and thought.text
    assert message.type == "message" and message.content[0].text == response.output_text
    # what chat completions return for the same conversation: one request path
    chat = (
        api.chat.completions.create(
            model="tiny", messages=[user(ASK)], max_tokens=TOKENS, temperature=0
        )
        .choices[0]
        .message
    )
    assert thought.text == chat.model_extra["reasoning_content"]
    assert response.output_text == chat.content
    # the thinking, `</think>` included, is CLOSER_AT of the reply's tokens
    details = response.usage.output_tokens_details
    assert details.reasoning_tokens == CLOSER_AT < response.usage.output_tokens
    # cut short inside the thinking: all of the reply is reasoning, and incomplete
    cut = create(api, max_output_tokens=1)
    assert [(item.type, item.status) for item in cut.output] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]
    assert cut.output_text == "" and cut.usage.output_tokens_details.reasoning_tokens == 1


def test_streamed_events_build_the_same_response(api: openai.OpenAI) -> None:
    whole = create(api)
    events = list(create(api, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    deduped = [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]
    assert deduped == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    [done] = [event for event in events if event.type == "response.reasoning_text.done"]
    deltas = [event for event in events if event.type == "response.reasoning_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(done.item_id, 0, 0)}
    assert "".join(event.delta for event in deltas) == done.text
    added = events[2]
    item = added.item
    assert (item.type, item.status, item.content) == ("reasoning", "in_progress", [])
    final = events[-1].response
    assert final.output[0].id == done.item_id
    assert same(final, whole)


def same(one: Any, other: Any) -> bool:
    """Whether two responses are equal but for their ids and times."""

    def plain(response: Any) -> Any:
        dumped = response.model_dump(exclude={"id", "created_at", "completed_at"})
        for item in dumped["output"]:
            item.pop("id")
        return dumped

    return plain(one) == plain(other)


def test_reasoning_sent_back_and_stored(api: openai.OpenAI) -> None:
    first = create(api)
    assert api.responses.retrieve(first.id).model_dump() == first.model_dump()
    then = user("Another.")
    second = create(api, input=[then], previous_response_id=first.id)
    # the items as the SDK returns them, sent back: the reasoning item is accepted, and
    # left out of the prompt as the template leaves out earlier turns' thinking
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    explicit = create(api, input=[user(ASK), *sent_back, then])
    without = create(api, input=[user(ASK), sent_back[1], then])
    assert same(explicit, without)
    assert explicit.output_text == second.output_text
    assert explicit.usage.input_tokens == second.usage.input_tokens
    assert [item.type for item in second.output] == ["reasoning", "message"]


def test_calls_and_formats_hold_the_answer_only(api: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "paint", "parameters": COLOUR}]
    called = create(
        api, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=80
    )
    reasoning, call = called.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert (call.type, call.name) == ("function_call", "paint")
    assert json.loads(call.arguments)["colour"] in ("red", "blue")
    fmt = {"format": {"type": "json_schema", "name": "colour", "schema": COLOUR}}
    formatted = create(api, text=fmt, max_output_tokens=80)
    assert [item.type for item in formatted.output] == ["reasoning", "message"]
    assert json.loads(formatted.output_text)["colour"] in ("red", "blue")


def test_effort_none_turns_the_thinking_off(api: openai.OpenAI, thinking_model: Path) -> None:
    on = create(api)
    off = create(api, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0
    assert off.reasoning is not None and off.reasoning.effort == "none"
    closed = AutoTokenizer.from_pretrained(thinking_model).encode("<think>\n\n</think>\n\n")
    assert off.usage.input_tokens == on.usage.input_tokens + len(closed)
    assert create(api, reasoning={}).output_text == on.output_text


REFUSED = {
    "high": ({"effort": "high"}, "reasoning.effort"),
    "summary": ({"summary": "auto"}, "reasoning.summary"),
    "generate_summary": ({"generate_summary": "concise"}, "reasoning.generate_summary"),
    "all_turns": ({"context": "all_turns"}, "reasoning.context"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_be_honoured_is_refused_by_name(server: str, case: str) -> None:
    reasoning, param = REFUSED[case]
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 2, "reasoning": reasoning}
    response = httpx.post(f"{server}/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_a_model_that_does_not_reason(tiny_server: str) -> None:
    api = client(tiny_server)
    response = create(api, max_output_tokens=4)
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:
        create(api, max_output_tokens=4, reasoning={"effort": "none"})
    assert refused.value.body["param"] == "reasoning"  # type: ignore[index]


def test_thinking_variables() -> None:
    def asked(reasoning: Any) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"model": "m", "input": ASK, "reasoning": reasoning})

    qwen3 = ReasoningSyntax(always_open=False)
    assert thinking_variables(asked({"effort": "minimal"}), qwen3, QWEN3_TEMPLATE) == {
        "enable_thinking": False
    }
    assert thinking_variables(asked({"context": "auto"}), qwen3, CHAT_TEMPLATE) is None
    for reasoning, syntax in (({"effort": "none"}, qwen3), ({}, None)):
        with pytest.raises(OpenAIError) as refused:
            thinking_variables(asked(reasoning), syntax, CHAT_TEMPLATE)
        assert refused.value.param == ("reasoning.effort" if syntax else "reasoning")


def test_reasoning_tokens() -> None:
    spelled = ReasoningSyntax(always_open=True)
    tokened = ReasoningSyntax(always_open=True, end_id=9)
    assert reasoning_tokens(tokened, [1, 2, 9, 3], "ab", "c") == 3
    assert reasoning_tokens(tokened, [1, 2, 3], "abc", "") == 3  # cut short
    assert reasoning_tokens(spelled, [1, 2, 3, 4], "abc", "d") == 3
    assert reasoning_tokens(spelled, [1, 2], None, "ab") == 0
