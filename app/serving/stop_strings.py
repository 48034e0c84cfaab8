"""Stop strings honoured across token (and delta) boundaries.

A stop string can arrive split over several deltas ("\\n\\nUs" then "er:"), so text that could be
the start of a stop string is held back until the next delta tells whether it is one. The client
never sees any part of the stop string, nor anything after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Matched:
    """The result of feeding text: what may be sent now, and whether a stop string was met."""

    text: str
    is_stopped: bool
    stop: str | None = None  # the stop string met, when is_stopped


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stop_strings)
        self._held = ""  # a tail that may be the start of a stop string

    def feed(self, text: str) -> Matched:
        if not self._stops:
            return Matched(text, False)
        buffer = self._held + text
        earliest = self._earliest_stop(buffer)
        if earliest is not None:
            self._held = ""
            cut, stop = earliest
            return Matched(buffer[:cut], True, stop)
        num_held = self._num_chars_to_hold(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return Matched(buffer[:len(buffer) - num_held], False)

    def flush(self) -> str:
        """The held-back tail, once the output ended without meeting a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_stop(self, buffer: str) -> tuple[int, str] | None:
        """Where the text must be cut, and the stop string met there: the one that completes first,
        as if the text came one character at a time (so token boundaries never change the answer).
        Of stop strings completing on the same character, the longest wins."""
        found = [(index + len(stop), index, stop) for stop in self._stops if (index := buffer.find(stop)) >= 0]
        if not found:
            return None
        _, cut, stop = min(found)
        return cut, stop

    def _num_chars_to_hold(self, buffer: str) -> int:
        """The longest tail of buffer that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
