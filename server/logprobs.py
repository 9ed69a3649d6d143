"""Token log-probabilities in OpenAI's two formats: legacy (completions) and chat.

A token's text is what it decodes to alone, so a token holding part of a multi-byte
character shows as U+FFFD, as in OpenAI's own API; `bytes` is that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from engine.outputs import TokenLogprobs


class CompletionLogprobsFormatter:
    """Formats one choice's tokens, in order, possibly across several stream chunks.

    Invariant: `offset` is the character offset in the choice's text (echoed prompt
    included) where the next token starts, counting each token's decoded length.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, offset: int) -> None:
        self.tokenizer = tokenizer
        self.offset = offset

    def format(self, entries: Sequence[TokenLogprobs]) -> CompletionLogprobs:
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for entry in entries:
            text = token_text(self.tokenizer, entry.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(
                {token_text(self.tokenizer, token_id): lp for token_id, lp in entry.top}
            )
            result.text_offset.append(self.offset)
            self.offset += len(text)
        return result


def chat_logprobs(
    tokenizer: PreTrainedTokenizerBase, entries: Sequence[TokenLogprobs]
) -> ChatLogprobs:
    content = []
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        top = [_top(tokenizer, token_id, lp) for token_id, lp in entry.top]
        content.append(
            ChatTokenLogprob(
                token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def _top(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])
