"""What a replica does with each call from the ingress, Ray-free: `generate` (a whole request, or a
decode replica's part after receiving a hand-off) and `prefill` (a prefill replica's part). The Serve
deployment (cluster/replica.py) only forwards to it, so tests drive it on an engine without Ray."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from cluster.handoff import ReadBlocks, receive_blocks
from cluster.wire import HandoffNote, ReplicaCall, ended_event
from scheduling.engine import Engine, EngineOverloaded, EngineStopped
from scheduling.request import TokenEvent
from scheduling.scheduler import AdmissionError

logger = logging.getLogger(__name__)

# How long a prefill replica waits for its published blocks to be written before it says they were not.
PUBLISH_TIMEOUT_S = 30.0


class Publisher(Protocol):
    """The part of gpu.kv_handoff.KVPublisher a replica's calls use (the runner publishes)."""

    location: str

    def wait_published(self, hashes: Sequence[bytes], timeout_s: float) -> bool: ...


@dataclass(slots=True)
class HandoffCounters:
    """A replica's side of the KV hand-off (cluster/handoff.py), for /stats and /metrics."""

    published: int = 0  # prompts whose blocks a prefill replica published
    publish_failures: int = 0  # prompts it could not publish (the decode replica recomputes them)
    publish_seconds: float = 0.0  # waiting for the writes after the first token
    received: int = 0  # hand-offs a decode replica received
    blocks_received: int = 0
    blocks_missed: int = 0  # published blocks it could not read (recomputed)
    fetch_seconds: float = 0.0


class ReplicaCalls:
    def __init__(self, engine: Engine, replica_id: str, publisher: Publisher | None = None,
                 read_blocks: ReadBlocks | None = None) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.handoff = HandoffCounters()
        self._publisher = publisher
        self._read_blocks = read_blocks

    async def generate(self, call: ReplicaCall) -> AsyncGenerator[list[TokenEvent] | HandoffNote, None]:
        """The request's events, in batches: whatever is ready when the ingress reads goes as one item.
        A call that carries a hand-off first receives its blocks, and says so with a HandoffNote."""
        if call.handoff_location is not None:
            yield await self._received(call)
        try:
            stream = self.engine.submit(replace(call.request, arrival_time=time.monotonic(),
                                                token_ids=list(call.request.token_ids),  # the scheduler's own
                                                prompt_block_hashes=call.block_hashes))  # hashed once
        except (EngineOverloaded, EngineStopped, AdmissionError) as exc:
            yield [ended_event(call.request, None, "error", f"replica {self.replica_id} refused the request: {exc}")]
            return
        try:
            async for event in stream:
                yield [event, *stream.take_ready()]
        finally:
            stream.close()  # a no-op after the last event; an abort when the ingress cancelled the call

    async def prefill(self, call: ReplicaCall) -> AsyncGenerator[list[TokenEvent] | HandoffNote, None]:
        """A prefill replica's part of a request (cluster.handoff.prefill_request): its first token's
        events as they come, then where its prompt's blocks were published (None if they were not)."""
        last: TokenEvent | None = None
        async for events in self.generate(call):
            if isinstance(events, list):
                last = events[-1]
            yield events
        if last is not None and last.finish_reason != "error":
            yield await self._published(call.block_hashes)

    async def _published(self, hashes: tuple[bytes, ...]) -> HandoffNote:
        if self._publisher is None:
            raise RuntimeError(f"replica {self.replica_id} is not a prefill replica")
        started = time.perf_counter()
        published = await asyncio.to_thread(self._publisher.wait_published, hashes, PUBLISH_TIMEOUT_S)
        seconds = time.perf_counter() - started
        self.handoff.publish_seconds += seconds
        if not published:
            self.handoff.publish_failures += 1
            return HandoffNote(None, 0, seconds)
        self.handoff.published += 1
        return HandoffNote(self._publisher.location, len(hashes), seconds)

    async def _received(self, call: ReplicaCall) -> HandoffNote:
        """The published blocks of the call's prompt, into host blocks, before the request is admitted."""
        assert call.handoff_location is not None
        if self._read_blocks is None:
            return HandoffNote(None, 0, 0.0)
        try:
            note = await receive_blocks(self.engine, call.block_hashes, call.handoff_location, self._read_blocks)
        except Exception:  # the request is admitted anyway: its prompt is computed here
            logger.warning("replica %s could not receive a hand-off", self.replica_id, exc_info=True)
            note = HandoffNote(None, 0, 0.0)
        self.handoff.received += 1
        self.handoff.blocks_received += note.num_blocks
        self.handoff.blocks_missed += note.num_missed
        self.handoff.fetch_seconds += note.seconds
        return note
