"""From token events to text pieces: coalescing a backlog, a stream's interval, and the engine request closed
whatever happens."""

from __future__ import annotations

import pytest

from app.serving.generation import GenerationFailed, TextGeneration, TextPiece
from benchmarks.bench_stream import build_instant_engine
from config.settings import load_settings
from gpu.tokenizer import ByteTokenizer
from scheduling.engine import MAX_HOLD_S, Engine, RequestStream
from scheduling.request import PriorityClass, Request, RequestId, TokenEvent
from tests.app.conftest import INSTANT_SETTINGS
from tests.factories import VirtualClock, running, wait_until

TOKENIZER = ByteTokenizer()


def queued_stream(engine: Engine, texts: list[str], finish_reason: str | None = None) -> RequestStream:
    """A stream with events already waiting, as if its reader had fallen behind the engine."""
    stream = engine.submit(Request(RequestId("r"), [TOKENIZER.BOS], max_tokens=100))
    num_output = 0
    for i, text in enumerate(texts):
        tokens = tuple(TOKENIZER.encode(text))
        num_output += len(tokens)
        is_last = i == len(texts) - 1
        stream.push(TokenEvent(RequestId("r"), tokens, finish_reason if is_last else None, 1, num_output))
    return stream


@pytest.fixture
def engine() -> Engine:
    """An engine that is never started: the tests feed its streams by hand."""
    engine, _ = build_instant_engine(load_settings(environ={}, overrides=INSTANT_SETTINGS))
    return engine


async def pieces_of(generation: TextGeneration) -> list[TextPiece]:
    return [piece async for piece in generation.pieces()]


async def test_a_backlog_is_sent_as_one_piece(engine: Engine) -> None:
    stream = queued_stream(engine, ["Hel", "lo, ", "wor", "ld"], finish_reason="length")
    generation = TextGeneration(stream, TOKENIZER, [], coalesce=True)

    assert await pieces_of(generation) == [TextPiece("Hello, world", "length")]
    assert generation.usage.completion_tokens == 12


async def test_without_coalescing_each_event_is_a_piece(engine: Engine) -> None:
    stream = queued_stream(engine, ["Hel", "lo"], finish_reason="length")

    assert await pieces_of(TextGeneration(stream, TOKENIZER, [], coalesce=False)) == [
        TextPiece("Hel", None), TextPiece("lo", "length")]


async def test_a_stop_string_in_a_backlog_stops_the_request(engine: Engine) -> None:
    stream = queued_stream(engine, ["one ", "two ", "three"])
    generation = TextGeneration(stream, TOKENIZER, ["two"])

    assert await pieces_of(generation) == [TextPiece("one ", "stop", stop_string="two")]
    assert stream.is_finished


async def test_an_engine_error_raises(engine: Engine) -> None:
    stream = engine.submit(Request(RequestId("r"), [TOKENIZER.BOS], max_tokens=10))
    stream.push(TokenEvent(RequestId("r"), (), "error", 1, 0, error="the engine failed: RuntimeError"))

    with pytest.raises(GenerationFailed, match="engine failed"):
        await pieces_of(TextGeneration(stream, TOKENIZER, []))


async def test_a_reader_that_leaves_aborts_the_request(engine: Engine) -> None:
    stream = queued_stream(engine, ["a", "b"])
    pieces = TextGeneration(stream, TOKENIZER, [], coalesce=False).pieces()
    await anext(pieces)
    await pieces.aclose()

    async with running(engine):
        await wait_until(lambda: engine.stats()["requests_aborted"] == 1, what="the request to be aborted")
    assert engine.stats()["requests_finished"] == 0


def paced_stream(engine: Engine, interval: int, clock: VirtualClock) -> RequestStream:
    request = Request(RequestId("r"), [TOKENIZER.BOS], max_tokens=100, priority=PriorityClass.BATCH,
                      stream_interval=interval)
    return RequestStream(engine, request, clock)


X = tuple(TOKENIZER.encode("x"))


def token(stream: RequestStream, num_output: int, finish_reason: str | None = None) -> None:
    stream.push(TokenEvent(RequestId("r"), X, finish_reason, 1, num_output))


def test_a_stream_interval_wakes_the_reader_once_per_interval_with_one_event(engine: Engine) -> None:
    stream = paced_stream(engine, 4, VirtualClock())
    token(stream, 1)
    assert len(stream.take_ready()) == 1  # the first token goes at once

    for n in range(2, 5):
        token(stream, n)
    assert stream.take_ready() == []
    token(stream, 5)
    assert [(e.new_token_ids, e.num_output_tokens) for e in stream.take_ready()] == [(X * 4, 5)]

    token(stream, 6)
    token(stream, 7, finish_reason="length")  # the end is never held
    assert [(e.num_output_tokens, e.finish_reason) for e in stream.take_ready()] == [(7, "length")]


def test_held_tokens_go_once_the_next_one_comes_past_the_longest_hold(engine: Engine) -> None:
    clock = VirtualClock()
    stream = paced_stream(engine, 8, clock)
    token(stream, 1)
    stream.take_ready()
    token(stream, 2)
    clock.now = MAX_HOLD_S / 2
    token(stream, 3)
    assert stream.take_ready() == []

    clock.now = MAX_HOLD_S
    token(stream, 4)
    assert [(e.new_token_ids, e.num_output_tokens) for e in stream.take_ready()] == [(X * 3, 4)]

