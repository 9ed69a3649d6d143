"""The text of single tokens, decoded once per token id: for logprobs entries."""

from __future__ import annotations

from transformers.tokenization_utils_base import PreTrainedTokenizerBase


class TokenTexts:
    """`text(token_id)` is `tokenizer.decode([token_id])`, memoized.

    A vocabulary is finite, so the memo is bounded by its size. Used on the engine thread
    only (its tokenizer is the engine's).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text
