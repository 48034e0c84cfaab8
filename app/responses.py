"""OpenAI response objects: whole ones (`chat.completion`, `text_completion`) and SSE chunks.

A content chunk is sent once per token (or per coalesced run of tokens), so its bytes are built
from a prefix and a suffix encoded once per response around the JSON-escaped text; everything
else is encoded from dicts. `tests/app/test_responses.py` checks both encodings agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import orjson

from app.errors import error_body
from app.generation import TextPiece, Usage

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_error_event(message: str, type: str, code: str | None = None) -> bytes:
    """An error after the stream started: the status line is gone, so it travels as data."""
    return sse_event(error_body(message, type, None, code))


@dataclass(slots=True, frozen=True)
class Envelope:
    """The fields every object of one response repeats."""

    id: str
    created: int
    model: str
    service_tier: str | None

    def fields(self, object_type: str) -> dict[str, Any]:
        fields: dict[str, Any] = {"id": self.id, "object": object_type, "created": self.created,
                                  "model": self.model}
        if self.service_tier is not None:
            fields["service_tier"] = self.service_tier
        return fields


class ChunkEncoder(Protocol):
    """The SSE events of one streamed response."""

    def opening(self) -> bytes | None: ...

    def content(self, text: str) -> bytes: ...

    def finish(self, finish_reason: str) -> bytes: ...

    def usage(self, usage: Usage) -> bytes: ...


class _TemplatedChunks(ABC):
    """Chunks of one object type; subclasses say how a choice looks."""

    object_type: ClassVar[str]
    # The bytes of a content choice before and after its JSON-encoded text.
    content_before: ClassVar[bytes]
    content_after: ClassVar[bytes]

    def __init__(self, envelope: Envelope, include_usage: bool) -> None:
        self._envelope = envelope
        self._include_usage = include_usage
        head = orjson.dumps(envelope.fields(self.object_type))[:-1]  # the object left open
        self._content_prefix = b"data: " + head + b',"choices":[' + self.content_before
        usage_field = b',"usage":null' if include_usage else b""
        self._content_suffix = self.content_after + b"]" + usage_field + b"}\n\n"

    @abstractmethod
    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]: ...

    def opening(self) -> bytes | None:
        return None

    def content(self, text: str) -> bytes:
        return self._content_prefix + orjson.dumps(text) + self._content_suffix

    def finish(self, finish_reason: str) -> bytes:
        return self._chunk([self._choice("", finish_reason)])

    def usage(self, usage: Usage) -> bytes:
        return sse_event({**self._envelope.fields(self.object_type), "choices": [], "usage": usage.as_dict()})

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        payload = {**self._envelope.fields(self.object_type), "choices": choices}
        if self._include_usage:
            payload["usage"] = None
        return sse_event(payload)


class ChatChunks(_TemplatedChunks):
    object_type = "chat.completion.chunk"
    content_before = b'{"index":0,"delta":{"content":'
    content_after = b'},"logprobs":null,"finish_reason":null}'

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> bytes:
        """OpenAI's first chunk names the role; the content follows in later chunks."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])


class CompletionChunks(_TemplatedChunks):
    object_type = "text_completion"
    content_before = b'{"text":'
    content_after = b',"index":0,"logprobs":null,"finish_reason":null}'

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}


def chat_completion(envelope: Envelope, result: TextPiece, usage: Usage) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
              "finish_reason": result.finish_reason}
    return {**envelope.fields("chat.completion"), "choices": [choice], "usage": usage.as_dict()}


def text_completion(envelope: Envelope, result: TextPiece, usage: Usage) -> dict[str, Any]:
    choice = {"text": result.text, "index": 0, "logprobs": None, "finish_reason": result.finish_reason}
    return {**envelope.fields("text_completion"), "choices": [choice], "usage": usage.as_dict()}
