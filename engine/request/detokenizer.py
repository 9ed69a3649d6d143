"""Incremental detokenization: output token ids in, text deltas out, in O(1) per token.

Decoding one token alone is wrong in two ways: a multi-byte character may span several
tokens (alone they decode to U+FFFD), and SentencePiece-style tokenizers drop the space
of a word-initial token at the start of a decode. So each push decodes a short window of
recent tokens that starts at a character boundary whose text was already emitted, and
emits only what the window's text gained (the prefix/read-offset technique of vLLM and
TGI).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first output token: enough to give it its context
# (leading space, no special tokens at the window start), few enough to stay cheap.
PROMPT_CONTEXT_TOKENS = 5


def ids_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function of the ids alone.

    For a fast tokenizer whose `decode` and `_decode` are transformers' own and that cleans
    up no spaces, that is the Rust tokenizer's `decode`, which transformers calls after
    converting its arguments: called directly, it skips that conversion, which costs more
    than the decoding itself on a short window, once per token of every sequence.
    """
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams the text of a sequence's output tokens.

    Invariants, with `ids` = prompt context + output tokens pushed so far:
    - `ids[start:read]` decodes to `read_len` characters, all already emitted; `read` is a
      character boundary, and the window `ids[start:]` is what each push decodes.
    - `emitted` characters of `decode(ids[start:])` have been emitted (`>= read_len`).
    - No delta ends in U+FFFD: a trailing U+FFFD may still become a character when more
      bytes arrive, so it is held until a later character follows it or `flush()`.
    The detokenizer keeps no text: its caller owns the output text (see `StopChecker`).
    After `flush()`, the deltas joined equal the text the output adds to the prompt: for byte-level
    tokenizers (GPT-2 style, e.g. SmolLM2) that is `tokenizer.decode(output_ids)`; for
    SentencePiece-style ones the first token keeps its leading space, as in vLLM, so that
    prompt + text reads right. A prompt whose tail is not clean text gives no context, and
    then the text is `decode(output_ids)` for any tokenizer.
    Limits: while the text ends in U+FFFD (a run of invalid bytes) the window grows, so
    such a run costs O(run length) per push. Byte-fallback decoders turn a whole run of
    byte tokens into U+FFFDs if any byte in it is invalid, so after invalid bytes a shown
    character can differ from the final decode; valid UTF-8 streams exactly.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        self._ids = self._prompt_context(prompt_token_ids)
        self._start = 0
        self._read = len(self._ids)
        self._read_len = len(self._decode(self._ids))
        self._emitted = self._read_len

    def push(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._start :])
        stable = len(text.rstrip(REPLACEMENT_CHAR))
        delta = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        # Slide only at a character boundary, and only past tokens that showed text, so the
        # new window starts with emitted visible text (never with a skipped special token,
        # which would make a SentencePiece decoder drop the next word's space).
        if stable == len(text) and len(text) > self._read_len:
            self._start, self._read = self._read, len(self._ids)
            self._read_len = len(self._decode(self._ids[self._start : self._read]))
            self._emitted = self._read_len
        return delta

    def flush(self) -> str:
        """Emit what is held back (trailing U+FFFD); call once, when the sequence ends."""
        text = self._decode(self._ids[self._start :])
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The longest tail of at most PROMPT_CONTEXT_TOKENS prompt tokens whose text does not
        end in U+FFFD: a prompt ending mid-character would let the output's first bytes
        rewrite text counted as emitted."""
        first = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        for begin in range(first, len(prompt_token_ids)):
            tail = list(prompt_token_ids[begin:])
            if not self._decode(tail).endswith(REPLACEMENT_CHAR):
                return tail
        return []


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
            text = self._texts[token_id] = str(self._tokenizer.decode([token_id]))
        return text
