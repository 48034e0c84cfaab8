"""loadtest.client: reading a streamed chat as a client does, against a real fairlane server, a
bare socket server and byte streams cut the ways a network cuts them; and what the record keeps of a
request that did not end ok."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtest.client import (
    BAD_STREAM,
    DETAIL_CHARS,
    DROPPED,
    ERROR_EVENT,
    ERROR_RESPONSE,
    NO_DONE,
    NOT_A_CHUNK,
    NOT_JSON,
    OK,
    STREAM_ERROR,
    TIMEOUT,
    TRANSPORT_ERROR,
    RequestRecord,
    send_chat,
    sse_data,
    sse_lines,
)
from loadtest.workload import ChatRequest, LoadTenant
from tests.app.conftest import ServerThread, instant_context

# JSON may carry U+0085, U+2028 and U+2029 unescaped, and the server's orjson does: to SSE they are
# text (it ends lines at CR, LF and CRLF only), to str.splitlines they are line breaks.
UNICODE_LINE_BREAKS = "a\x85b\u2028c\u2029d"


@pytest.fixture(scope="module")
def unicode_breaks_server() -> Iterator[ServerThread]:
    """A real server whose every output is UNICODE_LINE_BREAKS, then EOS."""
    server = ServerThread(instant_context(UNICODE_LINE_BREAKS.encode())).start()
    yield server
    server.stop()


def chat_of(max_tokens: int = 64, drop_after: int | None = None) -> ChatRequest:
    return ChatRequest(LoadTenant("alice", "key"), "interactive", (("user", "hi"),), max_tokens, drop_after)


def record_of(request: ChatRequest) -> RequestRecord:
    return RequestRecord(request.tenant.tenant_id, request.klass, sent_at=0.0)


async def test_a_chunk_holding_unicode_line_separators_is_read_whole(unicode_breaks_server: ServerThread) -> None:
    request = chat_of(max_tokens=len(UNICODE_LINE_BREAKS.encode()))  # the request sets ignore_eos
    record = record_of(request)
    async with httpx.AsyncClient(base_url=unicode_breaks_server.base_url, timeout=30) as http:
        await send_chat(http, unicode_breaks_server.model_name, request, record, lambda: 1.0)

    assert record.outcome == OK
    assert record.completion_tokens == request.max_tokens
    assert (record.status, record.reason, record.detail) == (200, None, None)
    assert record.request_id and record.completion_id and record.completion_id.startswith("chatcmpl-")
    assert record.num_events > len(record.chunk_times) > 0 and record.num_bytes > 0


def data_line(text: str, *, space: bool = True) -> bytes:
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return (b"data: " if space else b"data:") + orjson.dumps(chunk)


USAGE_LINE = b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}'
# Everything a server may legally send: comments (keep-alives), an `event:` and an `id:` field,
# `data:` with and without its space, a two-line data field, LF, CRLF and CR line ends, a final
# usage chunk, multi-byte characters and the Unicode line separators inside JSON strings.
EVENTS = [
    (b": ping\r\n\r\n", None),
    (b"event: message\r\nid: 1\r\n" + data_line("h\u00e9llo") + b"\r\n\r\n", orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": "h\u00e9llo"}, "finish_reason": None}]}).decode()),
    (data_line(UNICODE_LINE_BREAKS, space=False) + b"\n\n", orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": UNICODE_LINE_BREAKS}, "finish_reason": None}]}).decode()),
    (b"data: first\rdata: second\r\r", "first\nsecond"),
    (b":\n" + USAGE_LINE + b"\n\n", USAGE_LINE.removeprefix(b"data: ").decode()),
    (b"data: [DONE]\r\n\r\n", "[DONE]"),
]
STREAM = b"".join(event for event, _ in EVENTS)
EXPECTED = [data for _, data in EVENTS if data is not None]


async def pieces_of(body: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        yield body[start:end]


async def data_of(body: bytes, cuts: list[int]) -> list[str]:
    return [data async for data in sse_data(sse_lines(pieces_of(body, cuts)))]


async def test_the_parser_reads_every_legal_form_of_the_stream() -> None:
    assert await data_of(STREAM, []) == EXPECTED


async def test_a_stream_cut_at_any_byte_reads_the_same() -> None:
    """Cut once at every position (inside a CRLF, a multi-byte character, a `data:` prefix), and into
    single bytes: the reads a network hands over are arbitrary."""
    for cut in range(1, len(STREAM)):
        assert await data_of(STREAM, [cut]) == EXPECTED, (cut, STREAM[:cut][-12:])
    assert await data_of(STREAM, list(range(1, len(STREAM)))) == EXPECTED


@pytest.mark.parametrize(("tail", "data"), [(b"data: [DONE]", ["[DONE]"]), (b"data: [DONE]\r", ["[DONE]"]),
                                            (b"data: [DONE]\n", ["[DONE]"]), (b"", [])])
async def test_a_stream_ending_without_its_blank_line_keeps_its_last_event(tail: bytes, data: list[str]) -> None:
    assert await data_of(b": ping\n\n" + tail, []) == data


def sse_server(status: int, body: str, headers: dict[str, str] | None = None) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(
        status, text=body, headers={"content-type": "text/event-stream", **(headers or {})}))


async def send_to(transport: httpx.AsyncBaseTransport, request: ChatRequest) -> RequestRecord:
    record = record_of(request)
    ticks = iter(range(1, 100))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1") as http:
        await send_chat(http, "m", request, record, lambda: float(next(ticks)))
    return record


CHUNK = 'data: {"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"content": "%s"}, "finish_reason": null}]}\n\n'
USAGE = ('data: {"id": "chatcmpl-7", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, '
         '"prompt_tokens_details": {"cached_tokens": 4}}}\n\n')
ROLE = 'data: {"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
NOT_JSON_CHUNK = '{"id": "chatcmpl-7", "choices": [{"delta": {"content": "' + "x" * 300


@pytest.mark.parametrize(("status", "body", "drop_after", "outcome", "num_chunks"), [
    (200, ": ping\n\n" + ROLE + CHUNK % "a" + CHUNK % "bc" + USAGE + "data: [DONE]\n\n", None, OK, 2),
    (200, ROLE + CHUNK % "a" + CHUNK % "b" + CHUNK % "c", 2, DROPPED, 2),
    (200, CHUNK % "a" + 'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n', None, STREAM_ERROR, 1),
    (200, CHUNK % "a", None, BAD_STREAM, 1),  # no [DONE]: the stream was cut
    (200, "data: [1, 2]\n\n", None, BAD_STREAM, 0),
    (429, '{"error": {"message": "slow down"}}', None, "429", 0),
])
async def test_send_chat_times_a_stream_and_names_its_outcome(status: int, body: str, drop_after: int | None,
                                                              outcome: str, num_chunks: int) -> None:
    record = await send_to(sse_server(status, body), chat_of(8, drop_after))

    assert (record.outcome, len(record.chunk_times)) == (outcome, num_chunks)
    assert record.e2e_s is not None and record.e2e_s >= max(record.chunk_times, default=0.0)
    if num_chunks:
        assert record.ttft_s == record.chunk_times[0] and record.chunk_times == sorted(record.chunk_times)
    if outcome == "ok":  # usage wins over counting chunks
        assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (9, 3, 4)
    else:
        assert record.completion_tokens == num_chunks


@pytest.mark.parametrize(("body", "outcome", "reason", "detail", "num_events"), [
    (CHUNK % "a" + CHUNK % "b", BAD_STREAM, NO_DONE, None, 2),
    (CHUNK % "a" + f"data: {NOT_JSON_CHUNK}\n\n", BAD_STREAM, NOT_JSON, NOT_JSON_CHUNK[:DETAIL_CHARS], 2),
    ("data: [1, 2]\n\n", BAD_STREAM, NOT_A_CHUNK, "[1, 2]", 1),
    ('data: {"choices": [1]}\n\n', BAD_STREAM, NOT_A_CHUNK, '{"choices": [1]}', 1),
    (CHUNK % "a" + 'data: {"error": {"message": "boom", "type": "server_error"}}\n\n', STREAM_ERROR, ERROR_EVENT,
     "boom", 2),
])
async def test_a_stream_that_went_wrong_says_how(body: str, outcome: str, reason: str, detail: str | None,
                                                 num_events: int) -> None:
    record = await send_to(sse_server(200, body, {"x-request-id": "req-1"}), chat_of())

    assert (record.outcome, record.reason, record.detail) == (outcome, reason, detail)
    assert (record.status, record.request_id, record.num_events) == (200, "req-1", num_events)
    assert record.num_bytes == len(body.encode())
    assert record.completion_id == ("chatcmpl-7" if body.startswith(CHUNK[:20]) else None)
    assert record.failure_json()["reason"] == reason


@pytest.mark.parametrize(("status", "body", "detail"), [
    (429, '{"error": {"message": "slow down", "type": "rate_limit_error"}}', "slow down"),
    (502, "<html>bad gateway</html>", "<html>bad gateway</html>"),  # not OpenAI's shape: the body itself
])
async def test_an_error_response_keeps_its_status_and_message(status: int, body: str, detail: str) -> None:
    record = await send_to(sse_server(status, body, {"retry-after": "2", "x-request-id": "req-2"}), chat_of())

    assert (record.outcome, record.status, record.reason, record.detail) == (str(status), status, ERROR_RESPONSE,
                                                                             detail)
    assert (record.retry_after, record.request_id, record.num_bytes) == ("2", "req-2", len(body))


async def cut_after(pieces: list[bytes], exc: Exception) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece
    raise exc


def refuse_connection(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused")


@pytest.mark.parametrize(("answer", "outcome", "reason", "detail", "status", "num_events"), [
    (lambda request: httpx.Response(200, content=cut_after([(CHUNK % "a").encode()], httpx.ReadError("peer reset"))),
     TRANSPORT_ERROR, "ReadError", "peer reset", 200, 1),
    (lambda request: httpx.Response(200, content=cut_after([ROLE.encode()], httpx.ReadTimeout("timed out"))),
     TIMEOUT, "ReadTimeout", "timed out", 200, 1),
    (refuse_connection, TRANSPORT_ERROR, "ConnectError", "connection refused", None, 0),
])
async def test_a_transport_failure_keeps_the_exception_and_what_came_before(
        answer: Callable[[httpx.Request], httpx.Response], outcome: str, reason: str, detail: str,
        status: int | None, num_events: int) -> None:
    record = await send_to(httpx.MockTransport(answer), chat_of())

    assert (record.outcome, record.reason, record.detail, record.status) == (outcome, reason, detail, status)
    assert record.num_events == num_events and (record.num_bytes > 0) == (num_events > 0)
    assert record.e2e_s is not None


CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                b"x-request-id: req-3\r\n\r\n")


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.partition(b":")[2]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.mark.parametrize(("tail", "outcome", "reason"), [
    (b"0\r\n\r\n", BAD_STREAM, NO_DONE),  # the body ended as a body should: only [DONE] is missing
    (b"", TRANSPORT_ERROR, "RemoteProtocolError"),  # the connection closed inside the chunked body
])
async def test_a_stream_cut_by_its_server_is_told_from_one_ended_without_done(tail: bytes, outcome: str,
                                                                              reason: str) -> None:
    """A real socket: what a server that ends its response early sends, against one that drops the
    connection mid-body (a crash, a killed worker)."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # all of it: closing on unread bytes would send a reset, not an end
        writer.write(CHUNKED_HEAD + http_chunk((CHUNK % "a").encode()) + tail)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        request = chat_of()
        record = record_of(request)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            await send_chat(http, "m", request, record, lambda: 1.0)

    assert (record.outcome, record.reason, record.request_id, record.num_events) == (outcome, reason, "req-3", 1)


def test_failure_json_says_everything_the_client_knew() -> None:
    record = RequestRecord("alice", "chat", 12.34567, e2e_s=1.5, chunk_times=[13.0], status=200, request_id="r",
                           completion_id="chatcmpl-1", num_events=3, num_bytes=400)
    record.fail(BAD_STREAM, NOT_JSON, "y" * 500)
    found: dict[str, Any] = record.failure_json()

    assert found == {"tenant": "alice", "sent_at_s": 12.346, "elapsed_s": 1.5, "status": 200, "outcome": BAD_STREAM,
                     "reason": NOT_JSON, "detail": "y" * DETAIL_CHARS, "request_id": "r", "completion_id": "chatcmpl-1",
                     "num_events": 3, "num_content_chunks": 1, "num_bytes": 400}
