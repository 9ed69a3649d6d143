"""Token log-probabilities in OpenAI's two formats: legacy (completions) and chat.

A token's text is what it decodes to alone (the engine decodes it, see `TokenLogprobs`),
so a token holding part of a multi-byte character shows as U+FFFD, as in OpenAI's own
API; `bytes` is that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from server.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

if TYPE_CHECKING:
    from engine.outputs import TokenLogprobs


class CompletionLogprobsFormatter:
    """Formats one choice's tokens, in order, possibly across several stream chunks.

    Invariant: `offset` is the character offset in the choice's text (echoed prompt
    included) where the next token starts, counting each token's decoded length.
    """

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def format(self, entries: Sequence[TokenLogprobs]) -> CompletionLogprobs:
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for entry in entries:
            result.tokens.append(entry.token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(
                {text: lp for text, (_, lp) in zip(entry.top_tokens, entry.top, strict=True)}
            )
            result.text_offset.append(self.offset)
            self.offset += len(entry.token)
        return result

    def format_prompt(
        self, first_token: str, entries: Sequence[TokenLogprobs | None], count: int
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens: the first (`first_token`, its text) with no logprob
        and no alternatives (null, as OpenAI's), then each entry with its `count` most likely
        alternatives."""
        head = CompletionLogprobs(
            tokens=[first_token], token_logprobs=[None], top_logprobs=[None],
            text_offset=[self.offset],
        )  # fmt: skip
        self.offset += len(first_token)
        rest = self.format([_cut(entry, count) for entry in entries[1:] if entry is not None])
        return joined(head, rest)


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """One choice's logprobs: `first`'s tokens, then `then`'s."""
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def _cut(entry: TokenLogprobs, count: int) -> TokenLogprobs:
    """`entry` with only its `count` most likely alternatives."""
    return replace(entry, top=entry.top[:count], top_tokens=entry.top_tokens[:count])


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], count: int) -> PromptLogprobs:
    """vLLM's shape: per prompt token None (the first) or the token's own entry, then its
    `count` most likely alternatives (ranks 1 to `count`), keyed by token id as a string."""
    result: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranked = {
            str(entry.token_id): PromptLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=entry.token
            )
        }
        alternatives = zip(entry.top[:count], entry.top_tokens[:count], strict=True)
        for rank, ((token_id, logprob), text) in enumerate(alternatives, start=1):
            ranked.setdefault(
                str(token_id), PromptLogprob(logprob=logprob, rank=rank, decoded_token=text)
            )
        result.append(ranked)
    return result


def chat_logprobs(entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for entry in entries:
        top = [
            TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))
            for text, (_, lp) in zip(entry.top_tokens, entry.top, strict=True)
        ]
        content.append(
            ChatTokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)
