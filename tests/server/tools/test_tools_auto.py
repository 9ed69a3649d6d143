"""`tool_choice: auto`: the model may answer in text, or call tools; once it begins a call
(the format's opener), the rest of the reply is held by a grammar to calls of the tools,
so a call's arguments always validate against the caller's schema.

First the grammars themselves, walked byte by byte; then a live server on a tiny model
whose tokenizer spells `<tool_call>` in one token, which a logit_bias makes the model write
first (a random model never writes it otherwise): the call it then makes validates, where
without the grammar its arguments were noise; and the same server's plain-text answers are
exactly those of no grammar at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.request.intake import SpecialTokens
from engine.sampling.params import StructuredOutputs
from server.chat_protocol import ChatCompletionRequest
from server.conversation import ToolRequest
from server.tools.call_formats import HermesFormat, Llama3JsonFormat
from server.tools.chat_tools import ToolSyntax
from tests.server.conftest import client, live_server, tiny_config
from tests.support.tiny_models import build_model
from tests.support.tool_schemas import (
    A_MOVE,
    A_PAINT,
    A_REFILL,
    ASK_PAINT,
    MOVE,
    PAINT,
    REFILL,
    TOOLS,
    calls_and_finish_reason,
    valid_call,
    walks,
)

HERMES, LLAMA = HermesFormat(), Llama3JsonFormat()
FUNCTIONS = [PAINT, REFILL, MOVE]
CALLS = [("paint", A_PAINT), ("refill", A_REFILL), ("move", A_MOVE)]
BAD_CALLS = [
    ("paint", A_PAINT | {"color": "cyan"}),  # the other tool's enum
    ("paint", A_PAINT | {"path": [{"x": 1, "y": 1, "z": 1}]}),  # additionalProperties
    ("paint", {k: v for k, v in A_PAINT.items() if k != "anchor"}),  # required
    ("refill", A_REFILL | {"amount": 9}),  # maximum
    ("move", A_MOVE | {"then": [4]}),  # through #/properties/first to #/definitions
    ("delete_everything", {}),  # not a tool
]
TEXTS = ["", "Sure, I can paint that.", "Two lines\nand a brace { and a <tag>.", "a <tool_cal"]


def grammar(tool_format: Any, parallel: bool) -> str:
    text = llguidance.grammar_from("lark", tool_format.auto_grammar(FUNCTIONS, parallel))
    assert llguidance.LLMatcher.validate_grammar(text) == ""
    return text


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("parallel", [False, True])
def test_auto_allows_any_text(tool_format: Any, parallel: bool) -> None:
    for text in TEXTS:
        assert walks(grammar(tool_format, parallel), text), text


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("before", ["", "Let me paint.\n", "I'll call <tool> now "])
def test_hermes_auto_allows_text_then_calls_that_validate(parallel: bool, before: str) -> None:
    auto = grammar(HERMES, parallel)
    for call in CALLS:
        text = before + HERMES.render_call(*call)
        assert walks(auto, text), text
        content, [parsed] = HERMES.parse(text)
        assert content == (before.strip() or None)
        jsonschema.validate(json.loads(parsed.arguments), FUNCTIONS[CALLS.index(call)].parameters)
    several = before + "\n".join(HERMES.render_call(*call) for call in CALLS)
    assert walks(auto, several) is parallel  # parallel_tool_calls: false allows one


@pytest.mark.parametrize("parallel", [False, True])
def test_llama3_auto_allows_text_or_calls_that_validate(parallel: bool) -> None:
    auto = grammar(LLAMA, parallel)
    for call in CALLS:
        assert walks(auto, LLAMA.render_call(*call))
        assert walks(auto, " \n" + LLAMA.render_call(*call))
    several = "; ".join(LLAMA.render_call(*call) for call in CALLS)
    assert walks(auto, several) is parallel
    assert not walks(auto, '{"not": "a call"}')  # a reply that opens with `{` is a call


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize(("name", "arguments"), BAD_CALLS)
def test_auto_refuses_a_begun_call_the_schema_refuses(
    tool_format: Any, name: str, arguments: dict[str, Any]
) -> None:
    before = "Let me paint.\n" if tool_format is HERMES else ""
    for parallel in (False, True):
        auto = grammar(tool_format, parallel)
        assert not walks(auto, before + tool_format.render_call(name, arguments))


def test_hermes_auto_refuses_anything_but_a_call_after_the_opener() -> None:
    auto = grammar(HERMES, True)
    call = HERMES.render_call(*CALLS[1])
    for text in ["<tool_call> plain words", "ok <tool_call>\n{}", call + "\nand then text"]:
        assert not walks(auto, text), text


def test_auto_is_the_grammar_of_a_chat_request_with_tools() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    )
    request = ToolRequest.of(body)
    assert request is not None and request.forced is None and request.parallel
    spec = ToolSyntax(HERMES, template_takes_tools=False).offer(request).structured_outputs()
    assert spec.grammar == HERMES.auto_grammar(request.functions, True)


OPENER, CLOSER, THINK, THOUGHT = "<tool_call>", "</tool_call>", "<think>", "</think>"


@pytest.fixture(scope="module")
def opener_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The tiny Llama, with `<tool_call>`, `</tool_call>`, `<think>` and `</think>` tokens
    of its vocabulary that decode as text, as in Qwen3's; and the opener's id."""
    folder = build_model(tmp_path_factory.mktemp("tiny-opener"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([OPENER, CLOSER, THINK, THOUGHT])
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    [token_id] = tokenizer.encode(OPENER, add_special_tokens=False)
    return folder, token_id


@pytest.fixture(scope="module")
def opener_api(opener_model: tuple[Path, int]) -> Iterator[openai.OpenAI]:
    config = tiny_config(
        opener_model[0], served_model_name="tiny", max_model_len=4096, kv_cache_memory="128MiB"
    )
    with live_server(config) as url:
        yield client(url)


ASK = ASK_PAINT


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_begun_in_auto_mode_validates(
    opener_api: openai.OpenAI, opener_model: tuple[Path, int], stream: bool
) -> None:
    """The bias makes the model open a call at once (and keep preferring the opener): the
    grammar holds the rest to one call of a tool, with arguments the schema accepts."""
    reply = opener_api.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, temperature=0,
        parallel_tool_calls=False, logit_bias={str(opener_model[1]): 100}, stream=stream,
    )  # fmt: skip
    calls, finish_reason = calls_and_finish_reason(reply, stream)
    assert finish_reason == "tool_calls"
    [call] = calls
    valid_call(call.function.name, call.function.arguments)


def test_several_begun_calls_in_auto_mode_validate(
    opener_api: openai.OpenAI, opener_model: tuple[Path, int]
) -> None:
    reply = opener_api.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, temperature=0.8, seed=3, n=3,
        logit_bias={str(opener_model[1]): 100},
    )  # fmt: skip
    for choice in reply.choices:
        # Every complete call validates; a reply cut by max_tokens may end mid-call.
        assert choice.finish_reason == "tool_calls" or choice.finish_reason == "length"
        for call in choice.message.tool_calls or []:
            valid_call(call.function.name, call.function.arguments)
    assert any(choice.finish_reason == "tool_calls" for choice in reply.choices)


def test_a_plain_text_answer_is_still_possible(opener_api: openai.OpenAI) -> None:
    reply = opener_api.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_before_a_call_the_grammar_changes_nothing(tiny_model_paths: dict[str, Path]) -> None:
    """Greedy text under the auto grammar is the text without it, token for token (while
    it writes no opener), even where the random model writes bytes that are no text:
    nothing is constrained before a call begins."""
    llm = LLM(
        str(tiny_model_paths["llama"]), dtype="float32", device="cpu", max_model_len=256,
        kv_cache_memory="32MiB", enforce_eager=True,
    )  # fmt: skip
    auto = StructuredOutputs(grammar=HERMES.auto_grammar(FUNCTIONS, True))
    prompts = ["The quick brown fox", "Paged attention keeps", "def main():", "Héllo"]
    for prompt in prompts:
        free, held = (
            llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, **extra))[0]
            for extra in ({}, {"structured_outputs": auto})
        )
        assert OPENER not in free.outputs[0].text
        assert held.outputs[0].token_ids == free.outputs[0].token_ids, prompt


def token_grammar(folder: Path, parallel: bool) -> tuple[Any, llguidance.LLTokenizer, str]:
    """The tokenizer in `folder`, llguidance's view of it, and the auto grammar of
    `FUNCTIONS` as the server builds it for that tokenizer (`AsyncLLM.special_tokens`)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    syntax = ToolSyntax.of("hermes", None, SpecialTokens.of(tokenizer, len(tokenizer)))
    assert dict(syntax.tokens) == {m: tokenizer.convert_tokens_to_ids(m) for m in HERMES.markers}
    text = HERMES.auto_grammar(FUNCTIONS, parallel, syntax.tokens, syntax.special_ids)
    auto = llguidance.grammar_from("lark", text)
    assert llguidance.LLMatcher.validate_grammar(auto, ll_tokenizer) == ""
    return tokenizer, ll_tokenizer, auto


def test_an_opener_token_begins_a_call(opener_model: tuple[Path, int]) -> None:
    """Where `<tool_call>` is a token (Qwen's), that token opens the call as its spelling
    does, and `</tool_call>` may close it either way."""
    tokenizer, ll_tokenizer, auto = token_grammar(opener_model[0], False)
    opener, closer = (tokenizer.convert_tokens_to_ids(t) for t in (OPENER, CLOSER))
    body = tokenizer.encode("\n" + json.dumps({"name": "refill", "arguments": A_REFILL}) + "\n")
    spelt = tokenizer.encode("</") + tokenizer.encode("tool_call>")
    assert closer not in spelt
    for close in ([closer], spelt):
        matcher = llguidance.LLMatcher(ll_tokenizer, auto, log_level=0)
        assert all(matcher.consume_token(t) for t in [*tokenizer.encode("Sure. "), opener])
        assert all(matcher.consume_token(t) for t in body + close) and matcher.is_accepting()
    matcher = llguidance.LLMatcher(ll_tokenizer, auto, log_level=0)
    assert matcher.consume_token(opener)
    assert not matcher.consume_token(tokenizer.encode("Sure")[0])  # a call must follow


def test_special_tokens_are_those_of_the_grammar_engine(opener_model: tuple[Path, int]) -> None:
    """Every added token (also those that decode as text) and every id past the tokenizer
    (a padded vocabulary) is a special token to llguidance, which no text lexeme matches;
    so is the byte 0xFF (the marker of special tokens there), which is no text either."""
    tokenizer = AutoTokenizer.from_pretrained(opener_model[0])
    vocab_size = len(tokenizer) + 5
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    special = SpecialTokens.of(tokenizer, vocab_size)
    assert set(range(len(tokenizer), vocab_size)) < special.ids
    engine_special = {i for i in range(vocab_size) if ll_tokenizer.is_special_token(i)}
    assert special.ids <= engine_special
    [byte_ff] = engine_special - special.ids
    assert tokenizer.convert_ids_to_tokens(byte_ff) == "ÿ"  # byte-level BPE's 0xFF
    names = (OPENER, CLOSER, THINK, THOUGHT)
    assert special.text == {name: tokenizer.convert_tokens_to_ids(name) for name in names}


@pytest.mark.parametrize("parallel", [False, True])
def test_a_call_after_thinking_validates(opener_model: tuple[Path, int], parallel: bool) -> None:
    """Before a call every special token passes (Qwen3 thinks in `<think>...</think>`;
    `<|endoftext|>` and `<|im_start|>` too), and the call that follows is held to the
    tools' schemas, opened by the token or by its spelling."""
    tokenizer, ll_tokenizer, auto = token_grammar(opener_model[0], parallel)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (OPENER, CLOSER, THINK, THOUGHT)}
    others = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>")]
    thinking = [ids[THINK], *tokenizer.encode("Paint first."), *others, ids[THOUGHT]]
    thinking += tokenizer.encode("\nSure. ")

    def body(name: str, arguments: dict[str, Any]) -> list[int]:
        return tokenizer.encode("\n" + json.dumps({"name": name, "arguments": arguments}) + "\n")

    spelt = tokenizer.encode("<") + tokenizer.encode("tool_call>")
    assert ids[OPENER] not in spelt
    for opener in ([ids[OPENER]], spelt):
        matcher = llguidance.LLMatcher(ll_tokenizer, auto, log_level=0)
        call = [*opener, *body("refill", A_REFILL), ids[CLOSER]]
        assert all(matcher.consume_token(t) for t in thinking + call), matcher.get_error()
        assert matcher.is_accepting()
        for name, arguments in BAD_CALLS:
            matcher = llguidance.LLMatcher(ll_tokenizer, auto, log_level=0)
            tokens = [*thinking, *opener, *body(name, arguments), ids[CLOSER]]
            assert not all(matcher.consume_token(t) for t in tokens), (name, arguments)
        matcher = llguidance.LLMatcher(ll_tokenizer, auto, log_level=0)
        assert all(matcher.consume_token(t) for t in thinking + opener)
        assert not matcher.consume_token(ids[THINK])  # a call must follow
        assert not matcher.consume_token(tokenizer.encode("Sure")[0])


def test_before_a_call_special_tokens_pass_as_without_the_grammar(
    opener_api: openai.OpenAI, opener_model: tuple[Path, int]
) -> None:
    """The server's auto grammar on a model whose `<tool_call>` is a token: with a bias
    that makes the model think first (`<think>`, then text and more of them), the greedy
    reply is the reply to the same prompt without tools, hence without a grammar. Bytes
    that are no text are the one thing refused before such a call (the random model
    writes them; real ones hardly), so the bias keeps the model from them in both."""
    tokenizer = AutoTokenizer.from_pretrained(opener_model[0])
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    no_text = [i for i in range(len(tokenizer)) if not _is_text(ll_tokenizer.decode_bytes([i]))]
    think = tokenizer.convert_tokens_to_ids(THINK)
    described = [{"role": "system", "content": HERMES.instructions([PAINT, REFILL])}, *ASK]

    def reply(bias: float, **tools: Any) -> Any:
        logit_bias = {**dict.fromkeys(map(str, no_text), -100), str(think): bias}
        return opener_api.chat.completions.create(
            model="tiny", messages=tools.pop("messages", ASK), max_tokens=40, temperature=0,
            logit_bias=logit_bias, **tools,
        )  # fmt: skip

    # The least bias at which the model writes <think> first and then text as well.
    for bias in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        free = reply(bias, messages=described)
        text = free.choices[0].message.content or ""
        if text.startswith(THINK) and text.replace(THINK, "").strip():
            break
    else:
        pytest.fail("no bias makes the model think first and then write text")
    held = reply(bias, tools=TOOLS)
    assert held.usage.prompt_tokens == free.usage.prompt_tokens  # the same prompt
    choice = held.choices[0]
    assert choice.message.tool_calls is None
    assert (choice.message.content, choice.finish_reason) == (text, free.choices[0].finish_reason)


def _is_text(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
