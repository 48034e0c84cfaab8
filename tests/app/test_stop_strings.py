"""Stop strings: found across delta boundaries, never shown, nothing after them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.serving.stop_strings import StopStringMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """What the client sees of each delta (and the flush), and whether a stop string ended it."""
    matcher = StopStringMatcher(stops)
    shown = []
    for delta in deltas:
        matched = matcher.feed(delta)
        shown.append(matched.text)
        if matched.is_stopped:
            return shown, True
    return [*shown, matcher.flush()], False


def test_a_stop_string_split_over_deltas_is_held_back_then_cut() -> None:
    assert run(["User:"], ["Hi.\nUs", "er", ": more"]) == (["Hi.\n", "", ""], True)


def test_a_false_start_is_released() -> None:
    assert run(["User:"], ["Hi.\nUs", "e", "d it"]) == (["Hi.\n", "", "Used it", ""], False)


def test_text_held_at_the_end_is_flushed() -> None:
    assert run(["User:"], ["Hi.\nUse"]) == (["Hi.\n", "Use"], False)


def test_the_stop_that_completes_first_wins() -> None:
    assert run(["cd", "b"], ["abcd"]) == (["a"], True)
    assert run(["a", "baa"], ["baa"]) == (["b"], True)  # "a" is complete before "baa" is
    assert run(["b", "ab"], ["ab"]) == ([""], True)  # both complete at "b": the longer one cuts


def first_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """What the client should see when the text arrives one character at a time."""
    for end in range(1, len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[:end].endswith(stop)]
        if starts:
            return text[:min(starts)], True
    return text, False


def test_no_stop_strings_passes_text_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher([""])


@given(text=st.text(alphabet="ab你", max_size=30), stops=st.lists(st.text(alphabet="ab你", min_size=1, max_size=4),
                                                                   min_size=1, max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=5), max_size=30))
def test_token_boundaries_do_not_change_the_output(text: str, stops: list[str], cuts: list[int]) -> None:
    deltas, start = [], 0
    for size in [*cuts, len(text)]:
        deltas.append(text[start:start + size])
        start += size
    shown, is_stopped = run(stops, deltas)

    assert ("".join(shown), is_stopped) == first_stop(text, stops)
