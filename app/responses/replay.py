"""The events of streamed background responses, kept so that a client can re-attach.

A background response created with `stream: true` writes its event frames into an EventLog as it
runs. The client that created it, and any client of its tenant that re-attaches with
`GET /v1/responses/{id}?stream=true&starting_after=N`, follow the log: the frames already kept after
N at once, then each new one as it comes, until the response ends. Readers only read: one leaving
changes nothing for the generation or for the other readers.

The logs live in memory, owned by the event loop. A running response's log keeps its last
MAX_LOG_BYTES of frames (a tenant has at most `tenant_max_background_responses` running): a reader
that asks for, or falls behind to, a frame no longer kept gets an `error` event naming the first one
kept, and its stream ends. A finished one's is kept for KEEP_FINISHED_S, and only while the
finished logs together hold at most MAX_FINISHED_BYTES, the oldest dropped first. A response whose log
is gone (dropped, or finished before a restart) is streamed from its stored object (events.py's
`rebuilt_events`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable

from app.responses.events import sse_frame

KEEP_FINISHED_S = 600.0  # about as long as OpenAI keeps a background response's events
MAX_FINISHED_BYTES = 64 * 1024 * 1024
MAX_LOG_BYTES = 1024 * 1024  # of one log; when passed, its oldest frames go down to 3/4 of it


class EventLog:
    """One response's event frames in order: frame i is the event whose sequence_number is i."""

    def __init__(self, max_bytes: int = MAX_LOG_BYTES) -> None:
        self.frames: list[bytes] = []  # the kept frames: frame i has sequence number first + i
        self.first = 0
        self.num_bytes = 0
        self.max_bytes = max_bytes
        self.is_ended = False
        self._changed = asyncio.Event()  # set, then replaced by a fresh one, at every change

    @classmethod
    def ended(cls, frames: list[bytes]) -> EventLog:
        """A log that is already complete (a stream rebuilt from a stored response)."""
        log = cls(max_bytes=sum(len(frame) for frame in frames))
        log.append(frames)
        log.end()
        return log

    def append(self, frames: list[bytes]) -> None:
        assert not self.is_ended, "an ended log never grows: its readers have stopped following it"
        self.frames += frames
        self.num_bytes += sum(len(frame) for frame in frames)
        if self.num_bytes > self.max_bytes:
            self._forget_oldest()
        self._wake()

    def _forget_oldest(self) -> None:
        """Drop the oldest frames down to 3/4 of the bound (so that not every append copies the list);
        the last frame always stays."""
        target, num_dropped = self.max_bytes * 3 // 4, 0
        while num_dropped < len(self.frames) - 1 and self.num_bytes > target:
            self.num_bytes -= len(self.frames[num_dropped])
            num_dropped += 1
        del self.frames[:num_dropped]
        self.first += num_dropped

    def end(self) -> None:
        """No frame will follow (the response ended, was cancelled, or the server stops); idempotent."""
        self.is_ended = True
        self._wake()

    async def frames_after(self, starting_after: int | None) -> AsyncGenerator[bytes, None]:
        """The frames whose sequence number is greater than `starting_after` (every frame if None):
        the kept ones at once, then the new ones as they come, until the log ends; the frames at hand
        at each moment joined into one piece."""
        position = 0 if starting_after is None else starting_after + 1
        while True:
            if position < self.first:
                yield gone_frame(self.first)
                return
            # Read the frames, the end and the wake-up together (no await in between): whatever is
            # appended while the frames are sent has set `changed`, so it is never missed.
            frames, is_ended, changed = self.frames[position - self.first:], self.is_ended, self._changed
            if frames:  # as one piece: a replay of hundreds of kept frames is one send, not hundreds
                yield b"".join(frames)
            position += len(frames)
            if is_ended:
                return
            await changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def gone_frame(first_kept: int) -> bytes:
    """The `error` event of a reader whose next frame is no longer kept (no sequence number: it is not
    one of the response's events)."""
    message = (f"Events before sequence number {first_kept} are no longer kept for this running response; "
               f"re-attach with starting_after={first_kept - 1} or later, or retrieve the response once it ends.")
    return sse_frame({"type": "error", "code": "events_expired", "message": message, "param": "starting_after"})


class EventLogs:
    """The logs by response id: a running response's until it ends, then within the bounds above."""

    def __init__(self, *, keep_finished_s: float = KEEP_FINISHED_S, max_finished_bytes: int = MAX_FINISHED_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._keep_finished_s = keep_finished_s
        self._max_finished_bytes = max_finished_bytes
        self._clock = clock
        self._running: dict[str, EventLog] = {}
        self._finished: OrderedDict[str, tuple[EventLog, float]] = OrderedDict()  # with when it ended; oldest first
        self._num_finished_bytes = 0

    @property
    def num_finished_bytes(self) -> int:
        return self._num_finished_bytes

    def open(self, response_id: str) -> EventLog:
        log = self._running[response_id] = EventLog()
        return log

    def get(self, response_id: str) -> EventLog | None:
        """The response's log; None once it has been dropped (or if it never had one here)."""
        self._drop_expired()
        running = self._running.get(response_id)
        if running is not None:
            return running
        finished = self._finished.get(response_id)
        return finished[0] if finished is not None else None

    def end(self, response_id: str) -> None:
        """The response's generation is over: its log ends and is kept within the bounds."""
        log = self._running.pop(response_id, None)
        if log is None:
            return
        log.end()
        self._finished[response_id] = (log, self._clock())
        self._num_finished_bytes += log.num_bytes
        self._drop_expired()

    def drop(self, response_id: str) -> None:
        """The response was deleted: its events go at once (a reader still following it finishes)."""
        self.end(response_id)
        finished = self._finished.pop(response_id, None)
        if finished is not None:
            self._num_finished_bytes -= finished[0].num_bytes

    def _drop_expired(self) -> None:
        """Drop the oldest finished logs while one is too old or together they hold too much."""
        deadline = self._clock() - self._keep_finished_s
        while self._finished:
            log, ended_at = next(iter(self._finished.values()))
            if ended_at > deadline and self._num_finished_bytes <= self._max_finished_bytes:
                return
            self._finished.popitem(last=False)
            self._num_finished_bytes -= log.num_bytes
