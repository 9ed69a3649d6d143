"""Stop strings over a growing output text, and how much of that text is safe to stream."""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Holds one sample's output text, the only copy, and watches it for stop strings.

    Feed it the detokenizer's deltas with `append`; a stop string is found even when it
    spans several deltas. Invariants:
    - `text` never contains a stop string, except the matched one at its very end when
      `include_stop_str_in_output` is set; after a match `stopped` holds the stop string
      and the text no longer changes.
    - Text handed out by `stream()` is never taken back: while the text ends with the start
      of some stop string (e.g. "\\n" of "\\n\\n"), that suffix is held back.
    Each `append` searches only the new text plus the `max(len(stop)) - 1` characters
    before it, so checking costs O(len(delta)) per token, not O(len(text)).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(stop)
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._streamed = 0
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """The output text so far, truncated at the stop string once one matched."""
        return self._text

    def append(self, delta: str) -> str | None:
        """Add text; return the stop string that now ends the output, else None.

        When several stop strings match, the one starting first wins (then the one listed
        first), so the output is cut as early as possible.
        """
        if self.stopped is not None:
            raise RuntimeError("append after a stop string matched")
        search_from = max(len(self._text) - self._max_len + 1, 0)
        self._text += delta
        if not self._stops or not delta:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = self._text.find(stop, search_from)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        # Nothing streamed can lie inside the match: a stop's start is always held back.
        self._text = self._text[: position + len(stop) if self._include else position]
        self.stopped = stop
        return stop

    def stream(self, final: bool = False) -> str:
        """The text not yet streamed that is safe to send now.

        Holds back the longest suffix that is a proper prefix of a stop string, unless
        `final` (the sequence ended for another reason) or a stop string matched.
        """
        end = len(self._text)
        if not final and self.stopped is None:
            end -= self._held_back()
        delta = self._text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return delta

    def _held_back(self) -> int:
        tail_start = self._streamed
        for length in range(min(self._max_len - 1, len(self._text) - tail_start), 0, -1):
            suffix = self._text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
