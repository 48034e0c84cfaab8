"""Shutdown: new work gets 503, running streams get the grace period, the rest an error event."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.conftest import ServerThread, wait_for
from tests.app.sse import sse_frames, sse_payloads

FAIRLANE = Path(sys.executable).with_name("fairlane")


def stream_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}


class StreamReader(threading.Thread):
    """Reads one SSE response to its end in the background; `started` is set at the first bytes."""

    def __init__(self, base_url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.body = body
        self.started = threading.Event()
        self.content = b""

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=self.body) as response:
            for chunk in response.iter_bytes():
                self.content += chunk
                self.started.set()

    def finished_content(self, timeout: float = 30) -> bytes:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        return self.content


def test_streams_past_the_grace_period_end_with_an_error_event(
        start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server(shutdown_grace_s=0.2)
    reader = StreamReader(server.base_url, stream_body(server.model_name, 900))
    reader.start()
    assert reader.started.wait(30)

    server.stop()
    frames = sse_frames(reader.finished_content())

    assert frames[-1] == "[DONE]"
    assert '"error"' in frames[-2] and "shutting down" in frames[-2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def served_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`fairlane serve --model builtin:tiny` as a real process, killed if a test leaves it running."""
    port = free_port()
    env = {**os.environ, "FAIRLANE_SHUTDOWN_GRACE_S": "3", "FAIRLANE_KV_CACHE_BYTES": str(4 * 1024 * 1024),
           "FAIRLANE_SWAP_SPACE_BYTES": "0"}
    process = subprocess.Popen([str(FAIRLANE), "serve", "--model", "builtin:tiny", "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: is_ready(base_url) or process.poll() is not None, timeout=60, interval=0.1,
                 what="the server to start")
        assert process.poll() is None, process.communicate()[1].decode()
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def is_ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_sigterm_drains_then_exits(served_process: tuple[subprocess.Popen[bytes], str]) -> None:
    process, base_url = served_process
    short = StreamReader(base_url, stream_body("builtin:tiny", 120))  # ends within the 3 s grace period
    long = StreamReader(base_url, stream_body("builtin:tiny", 1000))  # cannot
    long.start()
    assert long.started.wait(30)
    short.start()
    assert short.started.wait(30)

    process.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{base_url}/health", timeout=5).status_code == 503, what="/health to say draining")
    refused = httpx.post(f"{base_url}/v1/completions", json={"model": "builtin:tiny", "prompt": "hi"}, timeout=5)

    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "server_shutting_down")
    assert sse_payloads(short.finished_content())[-1]["choices"][0]["finish_reason"] == "length"
    long_frames = sse_frames(long.finished_content())
    assert long_frames[-1] == "[DONE]" and "shutting down" in long_frames[-2]
    assert process.wait(timeout=15) == 0
