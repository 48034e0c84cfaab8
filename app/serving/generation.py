"""One request's output as text: token events in, detokenized and stop-string-checked pieces out.

Shared by the chat and completions endpoints, streaming or not. Whatever way the consumer stops
reading (end of output, stop string, client gone, server stopping), the engine request is closed
so its KV blocks are freed by the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from app.serving.detokenizer import IncrementalDetokenizer
from app.serving.stop_strings import StopStringMatcher
from contract.plan import TokenLogprobs
from gpu.tokenizer import Tokenizer
from scheduling.request import Request, RequestStatus, TokenEvent, merged


class GenerationFailed(Exception):
    """The engine ended the request with an error (a failed step, or the server stopping), or a
    later choice of the response could not be submitted (`status` says how to answer it)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(slots=True, frozen=True)
class TextPiece:
    text: str
    finish_reason: str | None  # "stop" or "length" on the last piece, else None
    # Of the tokens behind this piece (and behind any text held back before it), when asked for.
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # on the first piece, for prompt positions 1..
    stop_string: str | None = None  # on the last piece, the stop string that ended the output if one did


class TokenStream(Protocol):
    """What a generation reads: the engine's RequestStream, or one that submits later."""

    request: Request

    def __aiter__(self) -> Any: ...

    def take_ready(self) -> list[TokenEvent]: ...

    def close(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None: ...


class TextGeneration:
    """Iterate `pieces()` once; `usage` is complete when it ends. `started` is set once the first
    token (or the end) arrives: the prompt's KV blocks are then computed and cached."""

    def __init__(self, stream: TokenStream, tokenizer: Tokenizer, stop_strings: Sequence[str], *,
                 coalesce: bool = True) -> None:
        self._stream = stream
        self._coalesce = coalesce
        self._detokenizer = IncrementalDetokenizer(tokenizer, stream.request.prompt_token_ids)
        self._stops = StopStringMatcher(stop_strings)
        self._held_logprobs: tuple[TokenLogprobs, ...] = ()
        self._held_prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        self.usage = Usage(prompt_tokens=stream.request.num_prompt_tokens)
        self.started = asyncio.Event()

    @property
    def request(self) -> Request:
        return self._stream.request

    def close(self) -> None:
        """Abort the request (a no-op once it ended); for a generation whose pieces are never read."""
        self._stream.close(RequestStatus.FINISHED_ABORTED)

    async def pieces(self) -> AsyncGenerator[TextPiece, None]:
        try:
            async for event in self._stream:
                self.started.set()
                if self._coalesce:
                    event = merged(event, self._stream.take_ready())
                piece = self._on_event(event)
                if piece is None:
                    continue
                yield piece
                if piece.finish_reason is not None:
                    return
            raise GenerationFailed("the request ended without a result")
        finally:
            self.started.set()
            # A no-op after a normal end; aborts the request when the reader left early.
            self._stream.close(RequestStatus.FINISHED_ABORTED)

    def _on_event(self, event: TokenEvent) -> TextPiece | None:
        self.usage.completion_tokens = event.num_output_tokens
        self.usage.cached_tokens = event.num_cached_tokens
        if event.finish_reason in ("error", "abort"):
            raise GenerationFailed(event.error or "the request was aborted by the server")
        self._held_logprobs += event.logprobs
        self._held_prompt_logprobs += event.prompt_logprobs
        matched = self._stops.feed(self._detokenizer.add(self._text_tokens(event)))
        if matched.is_stopped:
            self._stream.close(RequestStatus.FINISHED_STOPPED)
            return self._piece(matched.text, "stop", matched.stop)
        if event.finish_reason is None:
            return self._piece(matched.text, None) if matched.text else None
        return self._last_piece(matched.text, event.finish_reason)

    def _text_tokens(self, event: TokenEvent) -> tuple[int, ...]:
        """The event's tokens that become text: a stop token ends the output without being shown
        (EOS decodes to nothing anyway; a token of `stop_token_ids` may be an ordinary one)."""
        tokens = event.new_token_ids
        if event.finish_reason == "stop" and tokens and tokens[-1] in self._stream.request.stop_token_ids:
            return tokens[:-1]
        return tokens

    def _piece(self, text: str, finish_reason: str | None, stop_string: str | None = None) -> TextPiece:
        logprobs, self._held_logprobs = self._held_logprobs, ()
        prompt_logprobs, self._held_prompt_logprobs = self._held_prompt_logprobs, ()
        return TextPiece(text, finish_reason, logprobs, prompt_logprobs, stop_string)

    def _last_piece(self, text: str, finish_reason: str) -> TextPiece:
        """The output ended: release what was held back, unless it completes a stop string."""
        tail = self._stops.feed(self._detokenizer.flush())
        if tail.is_stopped:
            return self._piece(text + tail.text, "stop", tail.stop)
        return self._piece(text + tail.text + self._stops.flush(), finish_reason)


async def collect(generation: TextGeneration) -> TextPiece:
    """The whole output as one piece (for non-streaming responses)."""
    parts: list[str] = []
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs] = []
    finish_reason: str | None = None
    stop_string: str | None = None
    async with aclosing(generation.pieces()) as pieces:
        async for piece in pieces:
            parts.append(piece.text)
            logprobs.extend(piece.logprobs)
            prompt_logprobs.extend(piece.prompt_logprobs)
            finish_reason, stop_string = piece.finish_reason, piece.stop_string
    return TextPiece("".join(parts), finish_reason, tuple(logprobs), tuple(prompt_logprobs), stop_string)
