"""Anthropic's response objects: a whole `message`, and the named SSE events of a streamed one.

A stream is `message_start`, then per content block `content_block_start`, its deltas (`text_delta`,
or `input_json_delta` for a tool call's input) and `content_block_stop`, then `message_delta` (the
stop reason and the usage) and `message_stop`; `ping` may come at any time, `error` ends a stream that
failed. A text delta is sent once per token (or coalesced run of tokens), so its bytes are a prefix
encoded once per block around the JSON-escaped text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.anthropic.translation import tool_use_id
from app.plumbing.json_lines import dumps_one_line
from app.serving.generation import Usage

PING_EVENT = b'event: ping\ndata: {"type":"ping"}\n\n'
MESSAGE_STOP_EVENT = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def usage_fields(usage: Usage, num_pinnable_tokens: int = 0) -> dict[str, int]:
    """Anthropic counts the prompt in parts that add up to it: the tokens read from the prefix cache,
    those written to it at a breakpoint (of the `num_pinnable_tokens` it keeps, those not read), and the
    rest. Without a breakpoint nothing counts as written: the prefix cache keeps every full block
    without being asked."""
    num_written = max(0, num_pinnable_tokens - usage.cached_tokens)
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens - num_written,
            "output_tokens": usage.completion_tokens, "cache_read_input_tokens": usage.cached_tokens,
            "cache_creation_input_tokens": num_written}


@dataclass(slots=True, frozen=True)
class MessageHead:
    """The fields every message of one response repeats."""

    id: str
    model: str
    num_pinnable_tokens: int = 0  # of its cache breakpoint (see Generations), for the usage

    def message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage(usage)}

    def usage(self, usage: Usage) -> dict[str, int]:
        return usage_fields(usage, self.num_pinnable_tokens)


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps_one_line(payload) + b"\n\n"


def error_event(error: dict[str, Any]) -> bytes:
    """A failure after the stream started: the status line is gone, so the error is an event."""
    return sse_event("error", error)


class MessageEvents:
    """The events of one streamed message. Blocks are opened as their content comes: a text block on
    the first text, a tool_use block on a call's first delta; opening one closes the one before."""

    def __init__(self, head: MessageHead) -> None:
        self._head = head
        self._num_blocks = 0
        self._open_block: str | None = None  # the type of the block open now
        self._text_prefix = b""  # a text delta event of the open text block, up to its text
        self._is_input_started = False  # whether the open tool_use block has sent any of its input
        self.has_tool_use = False

    def start(self, usage: Usage) -> bytes:
        message = self._head.message([], None, None, usage)
        return sse_event("message_start", {"type": "message_start", "message": message})

    def text(self, text: str) -> bytes:
        opening = b"" if self._open_block == "text" else self._open({"type": "text", "text": ""})
        if not self._text_prefix:
            self._text_prefix = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                                 + str(self._num_blocks - 1).encode() + b',"delta":{"type":"text_delta","text":')
        return opening + self._text_prefix + dumps_one_line(text) + b"}}\n\n"

    def tool_call(self, delta: dict[str, Any]) -> bytes:
        """One of the chat machinery's tool-call deltas: one with an id starts a call (and may carry
        the start of its arguments), the others continue the open one."""
        function = delta.get("function", {})
        events = b""
        if "id" in delta:
            self.has_tool_use = True
            events = self._open({"type": "tool_use", "id": tool_use_id(delta["id"]), "name": function["name"],
                                 "input": {}})
            self._is_input_started = False
        arguments = function.get("arguments", "")
        if not self._is_input_started:
            # Clients parse the input so far after every delta, and whitespace alone is no JSON yet.
            arguments = arguments.lstrip()
            self._is_input_started = bool(arguments)
        if arguments and self._open_block == "tool_use":
            events += sse_event("content_block_delta", {
                "type": "content_block_delta", "index": self._num_blocks - 1,
                "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def stop(self, stop_reason: str, stop_sequence: str | None, usage: Usage) -> bytes:
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 "usage": self._head.usage(usage)}
        return self._close() + sse_event("message_delta", delta) + MESSAGE_STOP_EVENT

    def _open(self, block: dict[str, Any]) -> bytes:
        events = self._close()
        self._open_block = block["type"]
        self._num_blocks += 1
        return events + sse_event("content_block_start", {"type": "content_block_start",
                                                          "index": self._num_blocks - 1, "content_block": block})

    def _close(self) -> bytes:
        if self._open_block is None:
            return b""
        self._open_block, self._text_prefix = None, b""
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self._num_blocks - 1})
