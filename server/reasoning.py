"""Reasoning: the part of a reply a model thinks in, told from the answer it gives.

Reasoning models write their thoughts between `<think>` and `</think>`, then the answer.
A parser is chosen per server (`reasoning_parser`; `auto` reads the chat template):

- `qwen3` (Qwen3, QwQ and others): a reply that opens with `<think>` reasons until
  `</think>`; one that opens otherwise is all answer. A prompt whose last tokens opened
  `<think>` without closing it (templates that start the thinking themselves, as
  Qwen3's thinking-only models do) makes the reply open in reasoning.
- `deepseek_r1`: every reply opens in reasoning (its template writes `<think>`; a
  `<think>` the model writes anyway is dropped), until `</think>`.
- `none`: every reply is all answer.

A reply cut short before `</think>` is all reasoning. Whitespace around the reasoning and
before the answer is dropped. Tool calls are read from the answer only, and structured
outputs and forced tool calls hold the answer only (`answer_only`): the reasoning before
it is free (server/openai/chat.py, server/anthropic/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.sampling.params import ReasoningBlock, StructuredOutputs

REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")
START, END = ReasoningBlock.START, ReasoningBlock.END


@dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    """How the served model reasons. `always_open`: every reply opens in reasoning
    (`deepseek_r1`); `start_id` and `end_id` are the ids of `<think>` and `</think>` where
    the tokenizer holds them as tokens of their own (read by `opens_in_reasoning`)."""

    always_open: bool
    start_id: int | None = None
    end_id: int | None = None

    @classmethod
    def of(
        cls, setting: str, chat_template: str | None, tokens: Mapping[str, int]
    ) -> ReasoningSyntax | None:
        """The syntax `setting` names (None for `none`); `auto` is `qwen3` when the chat
        template writes `<think>`. `tokens`: the tokenizer's added tokens that decode as
        text, by their text (`SpecialTokens.text`)."""
        if setting == "auto":
            setting = "qwen3" if START in (chat_template or "") else "none"
        if setting == "none":
            return None
        return cls(setting == "deepseek_r1", tokens.get(START), tokens.get(END))

    def block(self) -> ReasoningBlock:
        """The thinking as a grammar leaves it free (`StructuredOutputs.reasoning`)."""
        return ReasoningBlock(self.always_open, self.start_id, self.end_id)

    def opens_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a reply to this prompt begins inside its reasoning."""
        return self.block().opening(prompt_token_ids) == "inside"

    def stream(self, prompt_token_ids: Sequence[int]) -> ReasoningStream:
        """The splitter of one reply to this prompt."""
        return ReasoningStream(self.opens_in_reasoning(prompt_token_ids))


class ReasoningStream:
    """One reply's text, split into reasoning and answer as it streams.

    Invariant: `feed` returns only text whose side is decided, never a piece of a marker
    nor whitespace that might turn out to surround the reasoning or to open the answer;
    `finish` returns the rest. Fed the whole text at once, it splits it as it would piece
    by piece.
    """

    def __init__(self, open_at_start: bool) -> None:
        self._state = "start"  # before the reply's first words: a `<think>` may come
        self._open_at_start = open_at_start
        self._held = ""  # text not yet returned
        self._begun = False  # the current part's leading whitespace is behind

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and the answer that this much more text decides."""
        self._held += delta
        reasoning = ""
        if self._state == "start":
            text = self._held.lstrip()
            if len(text) < len(START) and START.startswith(text):
                return "", ""
            if text.startswith(START):
                self._enter("reasoning", text[len(START) :])
            else:
                self._enter("reasoning" if self._open_at_start else "answer", self._held)
        if self._state == "reasoning":
            self._skip_leading_space()
            end = self._held.find(END)
            if end == -1:
                # Hold what may begin `</think>`, and the whitespace before it.
                cut = len(self._held) - _partial_suffix(self._held, END)
                cut = len(self._held[:cut].rstrip())
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            reasoning = self._held[:end].rstrip()
            self._enter("answer", self._held[end + len(END) :])
        self._skip_leading_space()
        answer, self._held = self._held, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The reasoning and the answer not yet returned; a reply cut short inside its
        reasoning ends there (all of it was reasoning)."""
        if self._state == "start":
            self._enter("reasoning" if self._open_at_start else "answer", self._held)
        self._skip_leading_space()
        rest, self._held = self._held, ""
        return (rest.rstrip(), "") if self._state == "reasoning" else ("", rest)

    def _enter(self, state: str, held: str) -> None:
        self._state, self._held, self._begun = state, held, False

    def _skip_leading_space(self) -> None:
        if not self._begun:
            self._held = self._held.lstrip()
            self._begun = bool(self._held)


def answer_only(
    spec: StructuredOutputs | None, syntax: ReasoningSyntax | None
) -> StructuredOutputs | None:
    """`spec` holding the answer of a reply only, the reasoning before it free, when the
    model reasons (`syntax`); as it is otherwise."""
    if spec is None or syntax is None:
        return spec
    return dataclasses.replace(spec, reasoning=syntax.block())


def split_reasoning(
    syntax: ReasoningSyntax | None, prompt_token_ids: Sequence[int], text: str
) -> tuple[str | None, str]:
    """A whole reply's reasoning (None when it has none, or an empty one) and its answer."""
    if syntax is None:
        return None, text
    stream = syntax.stream(prompt_token_ids)
    reasoning, answer = stream.feed(text)
    more_reasoning, more_answer = stream.finish()
    return (reasoning + more_reasoning) or None, answer + more_answer


def reasoning_tokens(
    syntax: ReasoningSyntax, token_ids: Sequence[int], reasoning: str | None, answer: str
) -> int:
    """How many of a whole reply's tokens (`token_ids`, split into `reasoning` and
    `answer`) are its reasoning: none without reasoning; those up to its first `</think>`
    token, that one included; all of them for a reply with no answer (cut short inside
    its reasoning, or answering nothing after it); else, where the tokenizer spells
    `</think>` in pieces, the reasoning's share of the text's characters, rounded."""
    if reasoning is None:
        return 0
    if syntax.end_id is not None and syntax.end_id in token_ids:
        return list(token_ids).index(syntax.end_id) + 1
    if not answer:
        return len(token_ids)
    return round(len(token_ids) * len(reasoning) / (len(reasoning) + len(answer)))


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
