"""Several choices in one response: `n`, `best_of` and a list of completions prompts.

Each choice is its own engine request, so preemption, aborts and the fair queues see it like any
other (its tenant pays for every token it generates). Choices of one prompt share its KV blocks
through the prefix cache: the first is submitted at once and the others only when it has its first
token, so they find the prompt's full blocks computed instead of computing them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from app.serving.generation import GenerationFailed, TextGeneration, TextPiece, Usage, collect
from scheduling.engine import RequestStream
from scheduling.request import Request, RequestStatus, TokenEvent


class DeferredStream:
    """A choice's token stream whose request is submitted once `after` is set (its prompt's first
    choice has its first token). Closing it before then means it is never submitted."""

    def __init__(self, request: Request, submit: Callable[[Request], RequestStream], after: asyncio.Event,
                 on_never_submitted: Callable[[], None]) -> None:
        self.request = request
        self._submit = submit
        self._after = after
        self._on_never_submitted = on_never_submitted
        self._stream: RequestStream | None = None
        self._closed = False

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        await self._after.wait()
        if self._closed:
            return
        try:
            self._stream = self._submit(self.request)
        except GenerationFailed:
            self._closed = True
            raise
        async for event in self._stream:
            yield event

    def take_ready(self) -> list[TokenEvent]:
        return self._stream.take_ready() if self._stream is not None else []

    def close(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if self._stream is not None:
            self._stream.close(status)
        elif not self._closed:
            self._closed = True
            self._on_never_submitted()


@dataclass(slots=True)
class ChoiceSet:
    """The generations of one response, in choice order, and the usage they add up to."""

    generations: list[TextGeneration]
    # Indexes of the generations that own a prompt (the first choice of each): their prompt and
    # cached tokens count once in the usage.
    prompt_owners: list[int] = field(default_factory=lambda: [0])

    def usage(self) -> Usage:
        owners = [self.generations[i].usage for i in self.prompt_owners]
        return Usage(prompt_tokens=sum(u.prompt_tokens for u in owners),
                     completion_tokens=sum(g.usage.completion_tokens for g in self.generations),
                     cached_tokens=sum(u.cached_tokens for u in owners))

    async def collect_all(self) -> list[TextPiece]:
        """Every choice's whole output; the first failure cancels (and so aborts) the others. Raises
        the first GenerationFailed as itself: the task group wraps it in an ExceptionGroup, which
        the routes would answer with a bare 500 instead of the engine's reason."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(collect(g)) for g in self.generations]
        except ExceptionGroup as failures:
            failed = next((e for e in failures.exceptions if isinstance(e, GenerationFailed)), None)
            if failed is None:
                raise
            raise failed from None
        return [task.result() for task in tasks]

    async def interleaved(self) -> AsyncGenerator[tuple[int, TextPiece], None]:
        """(choice index, piece) as each choice produces them. Raises the first GenerationFailed."""
        if len(self.generations) == 1:  # the common case, without a task per choice
            async with aclosing(self.generations[0].pieces()) as pieces:
                async for piece in pieces:
                    yield 0, piece
            return
        async for item in _merged(self.generations):
            yield item


_END = object()


async def _merged(generations: Sequence[TextGeneration]) -> AsyncGenerator[tuple[int, TextPiece], None]:
    queue: asyncio.Queue[tuple[int, TextPiece | BaseException | object]] = asyncio.Queue()

    async def pump(index: int, generation: TextGeneration) -> None:
        try:
            async with aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    queue.put_nowait((index, piece))
        except GenerationFailed as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, GenerationFailed):
                raise item
            elif isinstance(item, TextPiece):
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a reader gone, or a failure: every other choice is aborted too
        await asyncio.gather(*tasks, return_exceptions=True)
