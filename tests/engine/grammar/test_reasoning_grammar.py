"""A structured output after a reasoning model's thinking: the grammar the compiler makes
for each place a reply can begin (inside the thinking, before it, after it), fed token by
token through llguidance's matcher with a tokenizer that holds `<think>` and `</think>`
as tokens of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from engine.grammar.grammar import GrammarCompiler
from engine.sampling.params import ReasoningBlock, StructuredOutputs
from tests.support.tiny_models import build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("reasoning-tokenizer"))
    tokenizer.add_tokens([ReasoningBlock.START, ReasoningBlock.END])
    return tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerFast) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(
    compiler: GrammarCompiler,
    tokenizer: PreTrainedTokenizerFast,
    prompt: str,
    reply: str,
    spec: StructuredOutputs,
) -> bool:
    """Whether the grammar of `spec` after `prompt` takes all of `reply` and may end."""
    matcher = compiler.matcher(compiler.compile(spec, tokenizer.encode(prompt)))
    for token in tokenizer.encode(reply):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize(
    ("prompt", "reply", "taken"),
    [
        # The reply may think first, or answer at once.
        ("Q:", '{"a":1}', True),
        ("Q:", '<think>I ponder.</think>\n\n{"a":1}', True),
        ("Q:", '<think>I ponder.</think>{"a":12}', True),
        ("Q:", 'Well. {"a":1}', False),
        ("Q:", "<think>I ponder.</think>\n\nBlue.", False),
        ("Q:", '<think>I </think> ponder.</think>{"a":1}', False),  # the first one ends it
        ("Q:", "<think>I ponder.", False),  # cut short
        # The prompt opened the thinking: text until </think> comes first.
        ("Q:<think>\n", 'I ponder.</think>\n{"a":1}', True),
        ("Q:<think>\n", '{"a":1}', False),
        # The prompt closed it (thinking off): the answer at once.
        ("Q:<think>\n\n</think>\n\n", '{"a":1}', True),
        ("Q:<think>\n\n</think>\n\n", '<think>I ponder.</think>{"a":1}', False),
    ],
)
def test_the_answer_is_held_after_free_thinking(
    compiler: GrammarCompiler,
    tokenizer: PreTrainedTokenizerFast,
    prompt: str,
    reply: str,
    taken: bool,
) -> None:
    start, end = tokenizer.convert_tokens_to_ids([ReasoningBlock.START, ReasoningBlock.END])
    block = ReasoningBlock(always_open=False, start_id=start, end_id=end)
    spec = StructuredOutputs(json=SCHEMA, reasoning=block)
    assert accepts(compiler, tokenizer, prompt, reply, spec) is taken


def test_every_kind_of_constraint_composes(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    start, end = tokenizer.convert_tokens_to_ids([ReasoningBlock.START, ReasoningBlock.END])
    block = ReasoningBlock(always_open=True, start_id=start, end_id=end)
    answers = [
        (StructuredOutputs(regex="[A-Z][a-z]+", reasoning=block), "Blue"),
        (StructuredOutputs(choice=["red", "blue"], reasoning=block), "blue"),
        (StructuredOutputs(grammar='start: "x" NUM\nNUM: /[0-9]+/', reasoning=block), "x42"),
        (StructuredOutputs(json_object=True, reasoning=block), '{"b":[]}'),
    ]
    for spec, answer in answers:
        # always_open (deepseek_r1): the reply begins inside the thinking.
        assert accepts(compiler, tokenizer, "Q:", f"Hm.</think>{answer}", spec), spec.kind
        assert not accepts(compiler, tokenizer, "Q:", answer, spec), spec.kind


def test_without_marker_tokens_the_spelling_does(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path)  # `<think>` is text here, several tokens
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = StructuredOutputs(regex="[A-Z][a-z]+", reasoning=ReasoningBlock(always_open=False))
    assert accepts(compiler, tokenizer, "Q:", "<think>Hm.</think>\nBlue", spec)
    assert accepts(compiler, tokenizer, "Q:", "Blue", spec)
    assert not accepts(compiler, tokenizer, "Q:", "Hm.</think>Blue", spec)
