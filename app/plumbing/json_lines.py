"""JSON that no line-based reader splits.

JSON leaves U+0085, U+2028 and U+2029 raw inside strings, and many readers take them as line ends:
Python's `str.splitlines` (and so httpx's `aiter_lines`), older JavaScript parsers. A generated text
holding one would cut an SSE `data:` line or a JSONL line in two for such a reader, so every line the
server streams or stores is written with the three escaped: still the same JSON value.
"""

from __future__ import annotations

from typing import Any

import orjson

# The three characters in UTF-8, and their JSON escapes. Each UTF-8 sequence is only ever that character.
_RAW_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def dumps_one_line(value: Any) -> bytes:
    """orjson's compact JSON of the value, with the line breaks JSON leaves raw escaped."""
    data = orjson.dumps(value)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:  # rare: the common chunk is returned as orjson made it
        for raw, escaped in _RAW_LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data
