"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n-gram (vLLM's "ngram" method, llama.cpp's lookup decoding)."""

from __future__ import annotations

from scheduler import Sequence


class NgramIndex:
    """Where each n-gram of one sequence's tokens, `min_n <= n <= max_n`, last ended.

    Invariant: `_latest[n - min_n]` maps every n-gram that ends (exclusive) at a position
    `e <= _indexed_end` to the largest such `e`. A sequence's tokens only grow (preemption
    keeps them), so each step indexes just the n-grams its new tokens end: O(new tokens x
    n range) a step, not O(context).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed_end = 0

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed, at its latest earlier occurrence, the
        longest of the context's last n-grams that occurred before; [] when none did."""
        length = seq.num_tokens
        self._index_up_to(seq, length - 1)  # every n-gram but the context's own last ones
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._latest[n - self.min_n].get(tuple(seq.get_token_ids(length - n, length)))
            if end is not None:
                return seq.get_token_ids(end, min(end + num_tokens, length))
        return []

    def _index_up_to(self, seq: Sequence, end: int) -> None:
        if end <= self._indexed_end:
            return
        start = max(self._indexed_end + 1 - self.max_n, 0)
        tokens = seq.get_token_ids(start, end)
        for n, latest in enumerate(self._latest, self.min_n):
            first = max(self._indexed_end + 1, n)  # the first new end with a whole n-gram
            for stop in range(first, end + 1):
                latest[tuple(tokens[stop - n - start : stop - start])] = stop
        self._indexed_end = end
