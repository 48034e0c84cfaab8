"""loadtest.client: reading a streamed chat as a client does, against a real fairlane server and
against byte streams cut the ways a network cuts them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest

from loadtest.client import OK, RequestRecord, send_chat, sse_data, sse_lines
from loadtest.workload import ANONYMOUS, ChatRequest
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


def chat_of(max_tokens: int = 64) -> ChatRequest:
    return ChatRequest(ANONYMOUS, "interactive", (("user", "hi"),), max_tokens)


def record_of(request: ChatRequest) -> RequestRecord:
    return RequestRecord(request.tenant.tenant_id, request.klass, sent_at=0.0)


async def test_a_chunk_holding_unicode_line_separators_is_read_whole(unicode_breaks_server: ServerThread) -> None:
    request = chat_of(max_tokens=len(UNICODE_LINE_BREAKS.encode()))  # the request sets ignore_eos
    record = record_of(request)
    async with httpx.AsyncClient(base_url=unicode_breaks_server.base_url, timeout=30) as http:
        await send_chat(http, unicode_breaks_server.model_name, request, record, lambda: 1.0)

    assert record.outcome == OK
    assert record.completion_tokens == request.max_tokens


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
