"""A client that goes away aborts its request: the KV blocks are free again within an engine step.

The sockets are really closed (raw sockets, no client library in between), and the tests wait
on /stats for the blocks to come back rather than sleeping.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from tests.app.conftest import ServerThread, wait_for

LONG_REQUEST = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def open_request(server: ServerThread, body: dict[str, object]) -> socket.socket:
    """Send a POST /v1/completions by hand and return the open socket."""
    address = urlsplit(server.base_url)
    assert address.hostname is not None and address.port is not None
    payload = json.dumps({"model": server.model_name, **body}).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection before sending {marker!r}: {received!r}"
        received += chunk
    return received


def wait_for_abort(server: ServerThread) -> dict[str, Any]:
    def aborted_and_freed() -> bool:
        stats = server.stats()
        return (stats["requests_aborted"], stats["kv_blocks_in_use"], stats["running"]) == (1, 0, 0)

    wait_for(aborted_and_freed, timeout=10, what="the request to be aborted and its KV blocks freed")
    return server.stats()


def test_closing_a_stream_aborts_the_request(start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    sock = open_request(server, {**LONG_REQUEST, "stream": True})
    with sock:
        read_until(sock, b'"text"')  # tokens are flowing
        assert server.stats()["kv_blocks_in_use"] > 0

    stats = wait_for_abort(server)
    assert stats["requests_finished"] == 0


def test_leaving_a_non_streaming_request_aborts_it(start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    sock = open_request(server, LONG_REQUEST)
    with sock:
        wait_for(lambda: server.stats()["running"] == 1, what="the request to run")

    stats = wait_for_abort(server)
    assert stats["requests_finished"] == 0


def test_a_queued_request_whose_client_left_never_runs(start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server(max_num_seqs=1, max_num_batched_tokens=64)
    running = open_request(server, {**LONG_REQUEST, "stream": True})
    with running:
        read_until(running, b'"text"')
        with open_request(server, {**LONG_REQUEST, "stream": True}):
            wait_for(lambda: server.stats()["waiting"] == 1, what="the second request to queue")
        wait_for(lambda: server.stats()["requests_aborted"] == 1, what="the queued request to be dropped")
        assert server.stats()["running"] == 1

    wait_for(lambda: server.stats()["requests_aborted"] == 2 and server.stats()["kv_blocks_in_use"] == 0,
             what="both requests to be aborted")


def test_leaving_an_n_choice_stream_aborts_every_choice(start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    sock = open_request(server, {**LONG_REQUEST, "stream": True, "n": 3, "max_tokens": 300})
    with sock:
        read_until(sock, b'"index":2')  # the third choice, submitted once the first had a token, is running
        assert server.stats()["running"] == 3

    def all_aborted() -> bool:
        stats = server.stats()
        return (stats["requests_aborted"], stats["kv_blocks_in_use"], stats["running"]) == (3, 0, 0)

    wait_for(all_aborted, timeout=10, what="the three choices to be aborted and their blocks freed")
    assert server.stats()["requests_finished"] == 0
