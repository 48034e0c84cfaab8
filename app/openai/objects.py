"""OpenAI response objects: whole ones (`chat.completion`, `text_completion`) and SSE chunks.

A content chunk is sent once per token (or per coalesced run of tokens), so the common one (choice
0, no log probabilities, no running usage) is built from a prefix and a suffix encoded once per
response around the JSON-escaped text; everything else is encoded from dicts.
`tests/app/test_responses.py` checks both encodings agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import orjson

from app.plumbing.errors import error_body
from app.plumbing.json_lines import dumps_one_line
from app.serving.generation import TextPiece, Usage
from contract.plan import TokenLogprobs
from gpu.tokenizer import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"
# log_softmax can reach -inf, which JSON cannot carry; vLLM reports the same floor.
LOGPROB_FLOOR = -9999.0


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps_one_line(payload) + b"\n\n"


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


@dataclass(slots=True, frozen=True)
class EchoedPrompt:
    """The log probabilities of an echoed prompt: its first token has none (nothing comes before it)."""

    first_token_id: int
    entries: tuple[TokenLogprobs, ...]  # one per later prompt token


@dataclass(slots=True)
class Choice:
    """One choice of a whole response."""

    index: int
    result: TextPiece
    prefix: str = ""  # the echoed prompt of a completion
    echoed_prompt: EchoedPrompt | None = None  # its log probabilities, when asked with echo
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # parsed from the output (chat with tools)

    @property
    def message(self) -> dict[str, Any]:
        if not self.tool_calls:
            return {"role": "assistant", "content": self.result.text}
        return {"role": "assistant", "content": self.result.text or None, "tool_calls": self.tool_calls}


class LogprobsFormat:
    """Token log probabilities in the chat shape (`content` entries) and the completions shape
    (parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        """The token's text; a token that is part of a UTF-8 character is written `bytes:\\xe4\\xbd`
        as OpenAI does, so distinct tokens never share a key in completions' top_logprobs."""
        data = self._tokenizer.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token_text(token_id), "logprob": max(logprob, LOGPROB_FLOOR),
                "bytes": list(self._tokenizer.token_bytes(token_id))}

    def chat(self, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
        content = [{**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}

    def completion(self, entries: tuple[TokenLogprobs, ...], start_offset: int,
                   echoed: EchoedPrompt | None = None) -> dict[str, Any]:
        """`start_offset`: where the first token's text starts in the choice's text (0 when the
        prompt is echoed: its tokens come first, the first of them with null log probabilities)."""
        if echoed is not None:
            entries = echoed.entries + entries
        tokens = [self.token_text(e.token_id) for e in entries]
        top: list[dict[str, float] | None] = [
            {**{self.token_text(t): max(lp, LOGPROB_FLOOR) for t, lp in e.top},
             tokens[i]: max(e.logprob, LOGPROB_FLOOR)} for i, e in enumerate(entries)]
        token_logprobs: list[float | None] = [max(e.logprob, LOGPROB_FLOOR) for e in entries]
        if echoed is not None:
            tokens.insert(0, self.token_text(echoed.first_token_id))
            top.insert(0, None)
            token_logprobs.insert(0, None)
        offsets = []
        for token in tokens:
            offsets.append(start_offset)
            start_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class ChunkEncoder(Protocol):
    """The SSE events of one streamed response."""

    def opening(self, index: int) -> bytes | None: ...

    def content(self, index: int, text: str, logprobs: tuple[TokenLogprobs, ...] = (),
                echoed: EchoedPrompt | None = None) -> bytes: ...

    def finish(self, index: int, finish_reason: str) -> bytes: ...

    def tool_calls(self, index: int, deltas: list[dict[str, Any]]) -> bytes: ...

    def usage(self, usage: Usage) -> bytes: ...


@dataclass(slots=True, frozen=True)
class StreamShape:
    """What a streamed response's chunks carry besides the text."""

    include_usage: bool = False  # a last chunk with the usage; every other chunk says "usage": null
    continuous_usage: bool = False  # the usage so far on every chunk (vLLM's continuous_usage_stats)
    logprobs: LogprobsFormat | None = None  # set when the request asked for log probabilities


class _TemplatedChunks(ABC):
    """Chunks of one object type; subclasses say how a choice looks."""

    object_type: ClassVar[str]
    # The bytes of a content choice before and after its JSON-encoded text.
    content_before: ClassVar[bytes]
    content_after: ClassVar[bytes]

    def __init__(self, envelope: Envelope, shape: StreamShape, usage_now: Callable[[], Usage] | None = None) -> None:
        self._envelope = envelope
        self._shape = shape
        self._usage_now = usage_now  # called for every chunk when shape.continuous_usage
        head = orjson.dumps(envelope.fields(self.object_type))[:-1]  # the object left open
        self._content_prefix = b"data: " + head + b',"choices":[' + self.content_before
        usage_field = b',"usage":null' if shape.include_usage else b""
        self._content_suffix = self.content_after + b"]" + usage_field + b"}\n\n"
        self._text_offsets: dict[int, int] = {}  # per choice, for the completions logprobs' text_offset

    @abstractmethod
    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]: ...

    @abstractmethod
    def _logprobs(self, index: int, text: str, entries: tuple[TokenLogprobs, ...],
                  echoed: EchoedPrompt | None = None) -> dict[str, Any]: ...

    def opening(self, index: int) -> bytes | None:
        return None

    def content(self, index: int, text: str, logprobs: tuple[TokenLogprobs, ...] = (),
                echoed: EchoedPrompt | None = None) -> bytes:
        if index == 0 and not logprobs and echoed is None and not self._shape.continuous_usage:
            return self._content_prefix + dumps_one_line(text) + self._content_suffix
        choice = self._choice(index, text, None)
        if (logprobs or echoed is not None) and self._shape.logprobs is not None:
            choice["logprobs"] = self._logprobs(index, text, logprobs, echoed)
        return self._chunk([choice])

    def finish(self, index: int, finish_reason: str) -> bytes:
        return self._chunk([self._choice(index, "", finish_reason)])

    def tool_calls(self, index: int, deltas: list[dict[str, Any]]) -> bytes:
        """Tool-call deltas (chat only): OpenAI's `delta.tool_calls`, each with its call's index."""
        return self._chunk([{"index": index, "delta": {"tool_calls": deltas}, "logprobs": None,
                             "finish_reason": None}])

    def usage(self, usage: Usage) -> bytes:
        return sse_event({**self._envelope.fields(self.object_type), "choices": [], "usage": usage.as_dict()})

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        payload = {**self._envelope.fields(self.object_type), "choices": choices}
        if self._shape.continuous_usage and self._usage_now is not None:
            payload["usage"] = self._usage_now().as_dict()
        elif self._shape.include_usage:
            payload["usage"] = None
        return sse_event(payload)


class ChatChunks(_TemplatedChunks):
    object_type = "chat.completion.chunk"
    content_before = b'{"index":0,"delta":{"content":'
    content_after = b'},"logprobs":null,"finish_reason":null}'

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _logprobs(self, index: int, text: str, entries: tuple[TokenLogprobs, ...],
                  echoed: EchoedPrompt | None = None) -> dict[str, Any]:
        assert self._shape.logprobs is not None
        return self._shape.logprobs.chat(entries)

    def opening(self, index: int) -> bytes:
        """OpenAI's first chunk of a choice names the role; the content follows in later chunks."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])


class CompletionChunks(_TemplatedChunks):
    object_type = "text_completion"
    content_before = b'{"text":'
    content_after = b',"index":0,"logprobs":null,"finish_reason":null}'

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}

    def _logprobs(self, index: int, text: str, entries: tuple[TokenLogprobs, ...],
                  echoed: EchoedPrompt | None = None) -> dict[str, Any]:
        assert self._shape.logprobs is not None
        start = self._text_offsets.get(index, 0)
        self._text_offsets[index] = start + len(text)
        return self._shape.logprobs.completion(entries, start, echoed)


def chat_completion(envelope: Envelope, choices: list[Choice], usage: Usage,
                    logprobs: LogprobsFormat | None = None) -> dict[str, Any]:
    body = [{"index": c.index, "message": c.message,
             "logprobs": logprobs.chat(c.result.logprobs) if logprobs else None,
             "finish_reason": c.result.finish_reason} for c in choices]
    return {**envelope.fields("chat.completion"), "choices": body, "usage": usage.as_dict()}


def text_completion(envelope: Envelope, choices: list[Choice], usage: Usage,
                    logprobs: LogprobsFormat | None = None) -> dict[str, Any]:
    body = [{"text": c.prefix + c.result.text, "index": c.index,
             "logprobs": logprobs.completion(c.result.logprobs, 0 if c.echoed_prompt else len(c.prefix),
                                             c.echoed_prompt) if logprobs else None,
             "finish_reason": c.result.finish_reason} for c in choices]
    return {**envelope.fields("text_completion"), "choices": body, "usage": usage.as_dict()}
