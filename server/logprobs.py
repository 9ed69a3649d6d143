"""Token log-probabilities in OpenAI's two formats: legacy (completions) and chat.

A token's text is what it decodes to alone (the engine decodes it, see `TokenLogprobs`),
so a token holding part of a multi-byte character shows as U+FFFD, as in OpenAI's own
API; `bytes` is that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

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
