"""StopChecker: stop strings across deltas, truncation, and hold-back while streaming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request.state import StopChecker


def feed(checker: StopChecker, deltas: list[str]) -> list[str]:
    """Append deltas until a stop; return what stream() handed out after each append."""
    streamed = []
    for delta in deltas:
        stop = checker.append(delta)
        streamed.append(checker.stream())
        if stop is not None:
            break
    return streamed


def test_stop_string_split_across_deltas_is_cut_and_never_streamed() -> None:
    checker = StopChecker(["STOP"])
    streamed = feed(checker, ["abc S", "T", "O", "P and more"])
    assert checker.stopped == "STOP"
    assert checker.text == "abc "
    assert streamed == ["abc ", "", "", ""]


def test_include_stop_str_in_output_keeps_the_stop() -> None:
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    streamed = feed(checker, ["abc ST", "OP and more"])
    assert checker.text == "abc STOP"
    assert "".join(streamed) == "abc STOP"


def test_text_after_a_stop_prefix_is_released_when_it_diverges() -> None:
    checker = StopChecker(["\n\n"])
    assert feed(checker, ["a\n", "b\n", "\n"]) == ["a", "\nb", ""]
    assert checker.text == "a\nb" and checker.stopped == "\n\n"


def test_final_stream_releases_held_text() -> None:
    checker = StopChecker(["</answer>"])
    assert feed(checker, ["42 </ans"]) == ["42 "]
    assert checker.stream(final=True) == "</ans"
    assert checker.stopped is None


def test_earliest_match_wins_then_list_order() -> None:
    checker = StopChecker(["cd", "bcd", "b"])
    checker.append("abcde")
    assert (checker.stopped, checker.text) == ("bcd", "a")
    checker = StopChecker(["xy", "x"])
    checker.append("axyz")
    assert (checker.stopped, checker.text) == ("xy", "a")


def test_without_stop_strings_everything_streams() -> None:
    checker = StopChecker([])
    assert feed(checker, ["a", "b\n"]) == ["a", "b\n"]
    assert checker.stopped is None


def test_append_after_stop_is_a_bug() -> None:
    checker = StopChecker(["x"])
    checker.append("x")
    with pytest.raises(RuntimeError):
        checker.append("y")


def reference(stops: list[str], deltas: list[str]) -> tuple[str, str | None]:
    """Full-text search after each delta: the first prefix holding a stop decides."""
    text = ""
    for delta in deltas:
        text += delta
        found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            position, _, stop = min(found)
            return text[:position], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab", min_size=1, max_size=4), max_size=3),
    deltas=st.lists(st.text("abc", max_size=4), max_size=12),
)
def test_matches_a_full_text_search_and_streams_a_prefix(
    stops: list[str], deltas: list[str]
) -> None:
    expected_text, expected_stop = reference(stops, deltas)
    checker = StopChecker(stops)
    streamed = "".join(feed(checker, deltas))
    assert (checker.text, checker.stopped) == (expected_text, expected_stop)
    assert expected_text.startswith(streamed)
    assert streamed + checker.stream(final=True) == expected_text
