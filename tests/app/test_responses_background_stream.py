"""Streamed background responses through the official openai client, against real servers: the client
that created one may leave and the response keeps running; it (or another client of the tenant)
re-attaches with GET ?stream=true&starting_after=N and gets every event after N, then the live ones;
the stream of a finished response is replayed, after a restart rebuilt from the stored response."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import Stream
from openai.types.responses import ResponseCreatedEvent, ResponseStreamEvent

from app.plumbing.errors import APIError
from app.responses.background import ReaderSlots
from app.responses.events import rebuilt_events
from app.responses.replay import EventLog, EventLogs
from app.responses.store import ResponseQuota, ResponseStore
from benchmarks.fake_executors import script_text
from tests.app.conftest import ServerThread, SteppedExecutor, fresh_db_path, instant_context, stepped_server, wait_for
from tests.tenants_files import tenants_toml

SCRIPT = "Hello from fairlane."
KEYS = {"alice": "fl-alice-key", "bob": "fl-bob-key"}
# A JSON answer the grammar forces letter by letter: builtin:tiny writes exactly this, then stops (completed).
STORY = "Once upon a time a tiny model wrote a story, one byte at a time, " * 6
STORY_FORMAT: Any = {"format": {"type": "json_schema", "name": "story", "strict": True, "schema": {
    "type": "object", "properties": {"story": {"type": "string", "enum": [STORY]}}, "required": ["story"],
    "additionalProperties": False}}}
ACTIVE = ("queued", "in_progress")


def client_of(server: ServerThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def status_of(client: openai.OpenAI, response_id: str) -> str | None:
    return client.responses.retrieve(response_id).status


def read_deltas(stream: Iterable[ResponseStreamEvent], num_deltas: int) -> list[ResponseStreamEvent]:
    """The events up to and including the num_deltas-th text delta."""
    events: list[ResponseStreamEvent] = []
    for event in stream:
        events.append(event)
        if sum(e.type == "response.output_text.delta" for e in events) == num_deltas:
            return events
    raise AssertionError(f"the stream ended before {num_deltas} deltas: {[e.type for e in events]}")


def id_of(events: list[ResponseStreamEvent]) -> str:
    """The response's id, from its stream's first event."""
    created = events[0]
    assert isinstance(created, ResponseCreatedEvent)
    return created.response.id


def text_of(events: list[ResponseStreamEvent]) -> str:
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


def assert_numbered_from(events: list[ResponseStreamEvent], first: int) -> None:
    assert [event.sequence_number for event in events] == list(range(first, first + len(events)))


def reattach(client: openai.OpenAI, response_id: str, starting_after: int | None = None
             ) -> Stream[ResponseStreamEvent]:
    if starting_after is None:
        return client.responses.retrieve(response_id, stream=True)
    return client.responses.retrieve(response_id, stream=True, starting_after=starting_after)


# ---- leaving and re-attaching ---------------------------------------------------------------------


def test_a_dropped_stream_keeps_running_and_resumes_after_its_cursor(
        start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    with client_of(server) as client:
        stream = client.responses.create(model=server.model_name, input="Tell me a story.", background=True,
                                         stream=True, text=STORY_FORMAT, max_output_tokens=600)
        with stream:
            first = read_deltas(stream, 3)
        created = first[0]
        assert created.type == "response.created" and created.response.status == "queued"
        assert first[1].type == "response.queued"
        response_id = id_of(first)

        wait_for(lambda: status_of(client, response_id) not in ACTIVE, timeout=120, what="the response to end")
        stored = client.responses.retrieve(response_id)
        cursor = first[-1].sequence_number
        with reattach(client, response_id, cursor) as resumed:
            rest = list(resumed)

    assert stored.status == "completed" and json.loads(stored.output_text) == {"story": STORY}
    assert_numbered_from(first + rest, 0)
    assert rest[0].sequence_number == cursor + 1
    assert rest[-1].type == "response.completed" and rest[-1].response.output_text == stored.output_text
    assert text_of(first + rest) == stored.output_text
    assert server.stats()["requests_aborted"] == 0


def test_reattaching_while_it_runs_replays_then_follows() -> None:
    server, executor = stepped_server(batch_stream_interval=1)  # a delta a token: the test counts them
    try:
        with client_of(server) as client:
            stream = client.responses.create(model=server.model_name, input="Hi", background=True, stream=True,
                                             max_output_tokens=40, extra_body={"ignore_eos": True})
            executor.allow(10)  # at most 10 of its 40 tokens: it cannot end before the test lets it
            with stream:
                first = read_deltas(stream, 3)
            response_id = id_of(first)
            # Leaving cancelled nothing: it is (and stays, with steps held) in progress.
            wait_for(lambda: status_of(client, response_id) == "in_progress", what="the response to be in progress")

            cursor = first[-1].sequence_number
            with reattach(client, response_id, cursor) as resumed:
                executor.open()
                rest = list(resumed)
            stored = client.responses.retrieve(response_id)
            num_aborted = server.stats()["requests_aborted"]
    finally:
        executor.open()
        server.stop()
    assert_numbered_from(first + rest, 0)
    assert rest[-1].type == "response.incomplete"
    assert text_of(first + rest) == stored.output_text == script_text(40)
    assert num_aborted == 0


def test_two_readers_follow_the_same_response() -> None:
    """One reader leaving disturbs neither the response nor the other reader."""
    server, executor = stepped_server(batch_stream_interval=1)  # a delta a token: the test counts them
    try:
        with client_of(server) as client:
            stream = client.responses.create(model=server.model_name, input="Hi", background=True, stream=True,
                                             max_output_tokens=30, extra_body={"ignore_eos": True})
            executor.allow(6)
            with stream:
                first = read_deltas(stream, 2)
                with reattach(client, id_of(first)) as other:
                    executor.open()
                    everything = list(other)
                rest = list(stream)
    finally:
        executor.open()
        server.stop()
    assert_numbered_from(everything, 0)
    assert first + rest == everything
    assert everything[-1].type == "response.incomplete" and text_of(everything) == script_text(30)


def test_a_cancel_ends_the_stream_without_an_end_event() -> None:
    server, executor = stepped_server()
    try:
        with client_of(server) as client:
            stream = client.responses.create(model=server.model_name, input="Hi", background=True, stream=True,
                                             max_output_tokens=500)
            executor.allow(3)
            with stream:
                first = read_deltas(stream, 1)
                assert client.responses.cancel(id_of(first)).status == "cancelled"
                executor.open()
                rest = list(stream)
            with reattach(client, id_of(first)) as replayed:
                again = list(replayed)
    finally:
        executor.open()
        server.stop()
    kinds = {event.type for event in first + rest}
    assert not kinds & {"response.completed", "response.incomplete", "response.failed"}
    assert again == first + rest  # the kept events of a cancelled response: as they were sent


# ---- finished responses ---------------------------------------------------------------------------


def test_a_finished_stream_is_replayed_whole_and_rebuilt_after_a_restart() -> None:
    db_path = fresh_db_path()
    server = ServerThread(instant_context(script=SCRIPT.encode(), batch_db_path=db_path)).start()
    try:
        with client_of(server) as client:
            with client.responses.create(model=server.model_name, input="Hi", background=True, stream=True) as live:
                sent = list(live)
            response_id = id_of(sent)
            with reattach(client, response_id) as replayed:
                assert list(replayed) == sent
    finally:
        server.stop()

    restarted = ServerThread(instant_context(script=SCRIPT.encode(), batch_db_path=db_path)).start()
    try:
        with client_of(restarted) as client:
            with reattach(client, response_id) as rebuilt:
                events = list(rebuilt)
            with client.responses.stream(response_id=response_id) as helper:
                final = helper.get_final_response()
            stored = client.responses.retrieve(response_id)
    finally:
        restarted.stop()
    assert_numbered_from(events, 0)
    assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert events[-1].type == "response.completed" and text_of(events) == SCRIPT == stored.output_text
    assert final.id == response_id and final.output_text == SCRIPT


async def leave_unfinished(db_path: str, response_id: str, model: str, tenant: str = "default") -> None:
    """What a killed server leaves of a streamed background response: a queued row and its request."""
    request = {"model": model, "input": "Hi", "background": True, "stream": True}
    response = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "queued",
                "background": True, "model": model, "output": []}
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}],
              "status": "completed"}]
    store = ResponseStore(db_path)
    try:
        await store.add(tenant, response, items, ResponseQuota(10, 1 << 20, 10), json.dumps(request))
    finally:
        await store.close()


def test_a_response_run_again_after_a_restart_streams_anew() -> None:
    db_path = fresh_db_path()
    asyncio.run(leave_unfinished(db_path, "resp_left_running", "instant"))
    server = ServerThread(instant_context(script=SCRIPT.encode(), batch_db_path=db_path)).start()
    try:
        with client_of(server) as client:
            with reattach(client, "resp_left_running") as stream:
                events = list(stream)
            stored = client.responses.retrieve("resp_left_running")
    finally:
        server.stop()
    assert_numbered_from(events, 0)
    assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert events[-1].type == "response.completed" and text_of(events) == SCRIPT == stored.output_text


def test_a_response_of_a_tenant_no_longer_served_fails_instead_of_running(tmp_path: Path) -> None:
    db_path = fresh_db_path()
    asyncio.run(leave_unfinished(db_path, "resp_of_carol", "instant", tenant="carol"))
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(tenants_toml(KEYS))  # carol has left the file
    server = ServerThread(instant_context(script=SCRIPT.encode(), batch_db_path=db_path,
                                          tenants_file=str(tenants_file))).start()
    try:
        wait_for(lambda: stored_status(db_path, "carol", "resp_of_carol") == "failed", what="carol's to fail")
        num_submitted = len(server.engine.submitted)
    finally:
        server.stop()
    assert num_submitted == 0


def stored_status(db_path: str, tenant: str, response_id: str) -> str | None:
    async def read() -> str | None:
        store = ResponseStore(db_path)
        try:
            stored = await store.get(tenant, response_id)
        finally:
            await store.close()
        return None if stored is None else str(stored.response["status"])

    return asyncio.run(read())


def test_only_a_background_response_created_with_stream_is_streamed(instant_server: ServerThread) -> None:
    with client_of(instant_server) as client:
        plain = client.responses.create(model=instant_server.model_name, input="Hi", max_output_tokens=4)
        polled = client.responses.create(model=instant_server.model_name, input="Hi", background=True,
                                         max_output_tokens=4)
        for response_id, reason in [(plain.id, "background=true"), (polled.id, "stream=true")]:
            with pytest.raises(openai.BadRequestError) as refused:
                reattach(client, response_id)
            assert refused.value.param == "stream" and reason in refused.value.message


@pytest.mark.parametrize("query", ["starting_after=-1", "starting_after=abc", "starting_after=1.5",
                                   "starting_after=", "starting_after=%C2%B2", "stream=maybe"])
def test_bad_stream_parameters_are_a_400(instant_server: ServerThread, query: str) -> None:
    with client_of(instant_server) as client, client.responses.create(
            model=instant_server.model_name, input="Hi", background=True, stream=True, max_output_tokens=4) as stream:
        response_id = id_of([next(iter(stream))])
    response = httpx.get(f"{instant_server.base_url}/v1/responses/{response_id}?stream=true&{query}", timeout=30)

    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == query.split("=")[0]


def test_a_cursor_past_the_end_gets_nothing_more(instant_server: ServerThread) -> None:
    with client_of(instant_server) as client:
        with client.responses.create(model=instant_server.model_name, input="Hi", background=True,
                                     stream=True, max_output_tokens=4) as stream:
            sent = list(stream)
        with reattach(client, id_of(sent), sent[-1].sequence_number) as after_the_end:
            assert list(after_the_end) == []


# ---- tenants --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(tenants_toml(KEYS))
    server = ServerThread(instant_context(script=SCRIPT.encode(), tenants_file=str(path))).start()
    yield server
    server.stop()


def test_another_tenants_stream_is_404(tenants_server: ServerThread) -> None:
    with client_of(tenants_server, KEYS["alice"]) as alice, client_of(tenants_server, KEYS["bob"]) as bob:
        with alice.responses.create(model=tenants_server.model_name, input="Alice's secret.", background=True,
                                    stream=True) as stream:
            sent = list(stream)
        response_id = id_of(sent)
        for starting_after in (None, 0, 2):
            with pytest.raises(openai.NotFoundError):
                reattach(bob, response_id, starting_after)
        with reattach(alice, response_id, 0) as own:
            assert list(own) == sent[1:]


# ---- the event logs -------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ended_log(logs: EventLogs, response_id: str, frames: list[bytes]) -> None:
    logs.open(response_id).append(frames)
    logs.end(response_id)


def test_finished_logs_are_dropped_after_a_while() -> None:
    clock = FakeClock()
    logs = EventLogs(keep_finished_s=60, clock=clock)
    ended_log(logs, "resp_old", [b"a"])
    clock.now = 30
    ended_log(logs, "resp_new", [b"b"])
    running = logs.open("resp_running")
    clock.now = 61

    assert logs.get("resp_old") is None and logs.get("resp_new") is not None
    assert logs.get("resp_running") is running  # a running response's log never expires
    clock.now = 1000
    assert logs.get("resp_new") is None and logs.get("resp_running") is running


def test_finished_logs_are_dropped_oldest_first_beyond_the_bytes_bound() -> None:
    logs = EventLogs(max_finished_bytes=10, clock=FakeClock())
    for response_id in ("resp_1", "resp_2", "resp_3"):
        ended_log(logs, response_id, [b"12345"])

    assert [logs.get(r) is not None for r in ("resp_1", "resp_2", "resp_3")] == [False, True, True]
    assert logs.num_finished_bytes == 10
    logs.drop("resp_2")
    assert logs.get("resp_2") is None and logs.num_finished_bytes == 5


async def test_a_reader_gets_the_kept_frames_then_the_new_ones() -> None:
    log = EventLog()
    log.append([b"0", b"1", b"2"])
    reader = log.frames_after(0)
    assert await anext(reader) == b"12"  # the kept frames, as one piece
    log.append([b"3"])
    assert await anext(reader) == b"3"
    log.end()
    assert [frame async for frame in reader] == []


def test_a_failed_response_is_rebuilt_with_its_error() -> None:
    response = {"id": "resp_1", "object": "response", "status": "failed", "output": [],
                "error": {"code": "server_error", "message": "The engine stopped."}}
    events = [json.loads(frame.split(b"data: ", 1)[1]) for frame in rebuilt_events(response)]

    assert [event["type"] for event in events] == ["response.created", "response.queued", "response.in_progress",
                                                   "error", "response.failed"]
    assert events[-2]["message"] == "The engine stopped." and events[-1]["response"] == response
    assert [event["sequence_number"] for event in events] == list(range(5))


async def test_a_running_log_keeps_its_last_frames_and_tells_a_reader_too_far_back() -> None:
    log = EventLog(max_bytes=40)
    log.append([b"%09d\n" % number for number in range(3)])  # 30 bytes: all kept
    behind = log.frames_after(None)
    assert await anext(behind) == b"000000000\n000000001\n000000002\n"
    log.append([b"%09d\n" % number for number in range(3, 6)])  # 60 bytes: down to 30, the last 3
    assert log.first == 3 and log.num_bytes == 30
    log.append([b"%09d\n" % number for number in range(6, 9)])
    assert log.first == 6

    gone = json.loads((await anext(behind)).split(b"data: ", 1)[1])  # frame 3 is no longer kept
    assert gone["code"] == "events_expired" and "starting_after=5" in gone["message"]
    assert [frame async for frame in behind] == []  # its stream ends there
    recent = log.frames_after(6)
    assert await anext(recent) == b"000000007\n000000008\n"


async def test_a_tenants_reattached_streams_are_bounded_and_each_frees_its_slot() -> None:
    slots = ReaderSlots(per_tenant=2)
    log = EventLog.ended([b"0", b"1"])
    first, second = slots.hold("alice", log.frames_after(None)), slots.hold("alice", log.frames_after(None))
    with pytest.raises(APIError) as refused:
        slots.hold("alice", log.frames_after(None))
    assert refused.value.status == 429
    await slots.hold("bob", log.frames_after(None)).aclose()  # bob has slots of his own

    await first.aclose()  # never started: closing it frees its slot all the same
    assert [frame async for frame in second] == [b"01"]
    await second.aclose()
    assert slots.open == {}


async def test_a_tenants_reattachments_per_minute_are_bounded_each_tenant_apart() -> None:
    """A re-attachment to an ended response replays its log at once: a loop of them is bounded by rate."""
    clock = [0.0]
    slots = ReaderSlots(per_tenant=4, per_minute=3, clock=lambda: clock[0])
    log = EventLog.ended([b"0"])
    for _ in range(3):
        await slots.hold("alice", log.frames_after(None)).aclose()
    with pytest.raises(APIError) as refused:
        slots.hold("alice", log.frames_after(None))
    assert refused.value.status == 429 and refused.value.headers["retry-after"] == "20"  # one every 20 s
    await slots.hold("bob", log.frames_after(None)).aclose()  # bob's rate is his own
    clock[0] = 20.0
    await slots.hold("alice", log.frames_after(None)).aclose()
    with pytest.raises(APIError):
        slots.hold("alice", log.frames_after(None))


def test_background_responses_at_once_are_bounded_per_tenant() -> None:
    server, executor = stepped_server(tenant_max_background_responses=2)
    try:
        with client_of(server) as client:
            running = [client.responses.create(model=server.model_name, input="Hi", background=True,
                                               max_output_tokens=40) for _ in range(2)]
            with pytest.raises(openai.RateLimitError) as refused:
                client.responses.create(model=server.model_name, input="Hi", background=True, max_output_tokens=40)
            assert refused.value.code == "storage_limit_exceeded"
            client.responses.cancel(running[0].id)
            third = client.responses.create(model=server.model_name, input="Hi", background=True,
                                            max_output_tokens=4)
            executor.open()
            wait_for(lambda: status_of(client, third.id) not in ACTIVE, what="the third to finish")
            assert status_of(client, third.id) == "incomplete"  # its 4 tokens written
    finally:
        executor.open()
        server.stop()


def running_streamed_response(client: openai.OpenAI, server: ServerThread, executor: SteppedExecutor) -> str:
    """A streamed background response past its first delta, left running (its creator gone): its id."""
    created = client.responses.create(model=server.model_name, input="Hi", background=True, stream=True,
                                      max_output_tokens=40)
    executor.allow(2)
    with created:
        return id_of(read_deltas(created, 1))


def test_a_reattachment_past_the_tenants_bound_is_a_429_until_one_closes() -> None:
    server, executor = stepped_server(tenant_max_reattached_streams=1)
    try:
        with client_of(server) as client:
            response_id = running_streamed_response(client, server, executor)
            with reattach(client, response_id) as following:
                next(iter(following))
                with pytest.raises(openai.RateLimitError):
                    reattach(client, response_id)
            wait_for(lambda: reattach_status(server, response_id) == 200, what="the slot to be freed")
    finally:
        executor.open()
        server.stop()


def reattach_status(server: ServerThread, response_id: str) -> int:
    with httpx.stream("GET", f"{server.base_url}/v1/responses/{response_id}?stream=true", timeout=10) as response:
        return response.status_code
