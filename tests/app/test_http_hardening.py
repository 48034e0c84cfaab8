"""Slow clients cannot hold the server: a request head must arrive whole in time, a body must keep
moving, and open connections are capped. Raw sockets, so nothing in between finishes a request for us.

The servers run with short timeouts; each wait below is bounded by many times those timeouts, so a
loaded machine does not make them fail, and an unbounded server does.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from urllib.parse import urlsplit

import httpx
import pytest

from tests.app.conftest import ServerThread, instant_context, wait_for

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.0
GENEROUS_S = 10.0  # far above either timeout: only a server that never closes runs into it
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    server = ServerThread(instant_context(http_header_timeout_s=HEADER_TIMEOUT_S,
                                          http_body_timeout_s=BODY_TIMEOUT_S)).start()
    yield server
    server.stop()


def connect(server: ServerThread) -> socket.socket:
    address = urlsplit(server.base_url)
    assert address.hostname is not None and address.port is not None
    return socket.create_connection((address.hostname, address.port), timeout=GENEROUS_S)


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open at the deadline."""
    received = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open; it sent {received!r}") from None
        if not chunk:
            return received
        received += chunk


def read_head(sock: socket.socket) -> bytes | None:
    """Bytes up to the end of a response head and past it; None if the server closed first."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        received += chunk
    return received


def split_response(received: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-cased names) and what came after the head."""
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a content-length, leaving the connection open."""
    received = read_head(sock)
    assert received is not None, "the server closed the connection without answering"
    status, headers, body = split_response(received)
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return status, headers, body


def assert_timeout_answer_or_nothing(received: bytes) -> None:
    """A connection cut for its slow head gets a 408 in OpenAI's shape, or nothing at all."""
    if received:
        status, _, body = split_response(received)
        assert status == 408
        assert json.loads(body)["error"]["code"] == "request_timeout"


def is_closed_within(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closes the connection (after a 408 or without a word) within wait_s."""
    sock.settimeout(wait_s)
    try:
        chunk = sock.recv(65536)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    if chunk:
        assert_timeout_answer_or_nothing(chunk + read_until_closed(sock, time.monotonic() + GENEROUS_S))
    return True


def test_a_half_sent_request_head_is_closed(server: ServerThread) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(PARTIAL_HEAD)
        received = read_until_closed(sock, started + GENEROUS_S)
    assert_timeout_answer_or_nothing(received)


def test_a_connection_that_sends_nothing_is_closed(server: ServerThread) -> None:
    with connect(server) as sock:
        received = read_until_closed(sock, time.monotonic() + GENEROUS_S)
    assert_timeout_answer_or_nothing(received)


def test_fifty_half_sent_heads_are_all_closed(server: ServerThread) -> None:
    with ExitStack() as stack:
        sockets = [stack.enter_context(connect(server)) for _ in range(50)]
        deadline = time.monotonic() + GENEROUS_S
        for sock in sockets:
            sock.sendall(PARTIAL_HEAD)
        for sock in sockets:
            assert_timeout_answer_or_nothing(read_until_closed(sock, deadline))


def test_a_trickled_head_is_cut_at_its_deadline(server: ServerThread) -> None:
    # A byte every fifth of the timeout: a deadline that each byte pushed back would never come.
    with connect(server) as sock:
        deadline = time.monotonic() + GENEROUS_S
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\nx-slow: ")
        while not is_closed_within(sock, HEADER_TIMEOUT_S / 5):
            assert time.monotonic() < deadline, "the server kept a trickled head open"
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return  # cut between two bytes


STALLED_JSON = (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n{\"prompt\": ")
# The Batch file upload streams its multipart body through Starlette's parser, not through read_body.
STALLED_UPLOAD = (b"POST /v1/files HTTP/1.1\r\nhost: test\r\ncontent-type: multipart/form-data; boundary=BB\r\n"
                  b"content-length: 1000\r\n\r\n--BB\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\n"
                  b"batch\r\n--BB\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n"
                  b"\r\n{\"a\":")


@pytest.mark.parametrize("stalled_request", [STALLED_JSON, STALLED_UPLOAD], ids=["json", "batch-upload"])
def test_a_stalled_body_gets_408_in_openai_shape(server: ServerThread, stalled_request: bytes) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(stalled_request)
        received = read_until_closed(sock, started + GENEROUS_S)
    status, headers, body = split_response(received)
    assert status == 408
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": None,
                     "code": "request_timeout"}
    assert "body" in error["message"]


def test_a_slow_body_that_keeps_moving_is_served(server: ServerThread) -> None:
    payload = json.dumps({"model": server.model_name, "prompt": "hi", "max_tokens": 2}).encode()
    num_pieces = 6
    size = -(-len(payload) // num_pieces)
    pieces = [payload[i:i + size] for i in range(0, len(payload), size)]
    pause_s = BODY_TIMEOUT_S / 4  # each wait well within the timeout, all of them well past it
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(payload))
        started = time.monotonic()
        for piece in pieces:
            time.sleep(pause_s)  # the slowness under test, not a wait for the server
            sock.sendall(piece)
        assert time.monotonic() - started > BODY_TIMEOUT_S, "the body must take longer than one timeout"
        status, _, body = read_response(sock)
    assert status == 200, body


def test_a_normal_request_is_served(server: ServerThread) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=GENEROUS_S,
                          json={"model": server.model_name, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]


def test_a_kept_alive_connection_serves_a_prompt_second_request(server: ServerThread) -> None:
    with connect(server) as sock:
        sock.sendall(HEALTH_REQUEST)
        first, headers, _ = read_response(sock)
        assert "close" not in headers.get("connection", "")
        sock.sendall(HEALTH_REQUEST)
        second, _, _ = read_response(sock)
    assert (first, second) == (200, 200)


def test_a_kept_alive_connection_that_stalls_in_its_next_head_is_closed(server: ServerThread) -> None:
    # Any byte cancels uvicorn's keep-alive timeout: without a head deadline this is held forever.
    with connect(server) as sock:
        sock.sendall(HEALTH_REQUEST)
        assert read_response(sock)[0] == 200
        sock.sendall(PARTIAL_HEAD)
        received = read_until_closed(sock, time.monotonic() + GENEROUS_S)
    assert_timeout_answer_or_nothing(received)


def health_status(server: ServerThread) -> int | None:
    """The status of GET /health on a new connection; None if the server closed it unanswered."""
    with connect(server) as sock:
        sock.sendall(HEALTH_REQUEST)
        received = read_head(sock)
    return None if received is None else split_response(received)[0]


def test_connections_past_the_cap_are_refused() -> None:
    capped = ServerThread(instant_context(max_connections=2)).start()
    try:
        with connect(capped) as first, connect(capped) as second:
            for held in (first, second):  # both are served and stay open
                held.sendall(HEALTH_REQUEST)
                assert read_response(held)[0] == 200
            assert health_status(capped) in (503, None)
        wait_for(lambda: health_status(capped) == 200, timeout=GENEROUS_S,
                 what="a new connection to be served once the held ones are closed")
    finally:
        capped.stop()
