"""Reading raw SSE bodies in tests: frames, their JSON payloads, and the text they carry."""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"


def sse_frames(body: bytes) -> list[str]:
    """The data of each event, checking the framing strictly: `data: ...` lines, blank-line separated."""
    assert body.endswith(b"\n\n"), body[-80:]
    frames = []
    for event in body.decode("utf-8").split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        frames.append(event.removeprefix("data: "))
    return frames


def sse_payloads(body: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a complete stream, which must end with exactly one [DONE]."""
    frames = sse_frames(body)
    assert frames[-1] == DONE and DONE not in frames[:-1], frames[-3:]
    return [json.loads(frame) for frame in frames[:-1]]


def streamed_text(payloads: list[dict[str, Any]]) -> str:
    """The text of a streamed chat or text completion."""
    parts = []
    for payload in payloads:
        for choice in payload.get("choices", []):
            parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    return "".join(parts)


def finish_reasons(payloads: list[dict[str, Any]]) -> list[str]:
    return [choice["finish_reason"] for payload in payloads for choice in payload.get("choices", [])
            if choice["finish_reason"] is not None]
