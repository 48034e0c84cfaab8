"""Shutdown: new work gets 503, running streams get the grace period, the rest an error event."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.conftest import stepped_server, wait_for
from tests.app.sse import sse_frames, sse_payloads

FAIRLANE = Path(sys.executable).with_name("fairlane")
# uvicorn's start-up line: with --port 0 it names the port the server bound.
STARTED_LINE = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


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


def test_streams_past_the_grace_period_end_with_an_error_event() -> None:
    server, executor = stepped_server(shutdown_grace_s=0.2)
    reader = StreamReader(server.base_url, stream_body(server.model_name, 100))
    try:
        reader.start()
        executor.allow(2)  # the first tokens; the stream's third step is held until the end
        assert reader.started.wait(30)
        server.server.request_shutdown()
        wait_for(lambda: server.engine.num_unfinished == 0, what="the drain to end the held stream")
    finally:
        executor.open()
        server.stop()
    frames = sse_frames(reader.finished_content())

    assert frames[-1] == "[DONE]"
    assert '"error"' in frames[-2] and "shutting down" in frames[-2]


class ServedProcess:
    """`fairlane serve --model builtin:tiny --port 0` as a real process. The server binds a free port
    itself (a number picked here could be taken before it binds) and uvicorn's start-up line on
    stderr says which; a thread keeps reading stderr so that the pipe never fills."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen([str(FAIRLANE), "serve", "--model", "builtin:tiny", "--port", "0"],
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.base_url = ""
        self._log_reader = threading.Thread(target=self._read_log, name="serve-log", daemon=True)
        self._log_reader.start()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self.log.append(line)
                if not self.base_url and (started := STARTED_LINE.search(line)):
                    self.base_url = started[1]

    def wait_ready(self) -> ServedProcess:
        wait_for(lambda: (self.base_url != "" and is_ready(self.base_url)) or self.process.poll() is not None,
                 timeout=60, interval=0.1, what="the server to start")
        if self.process.poll() is not None:
            self._log_reader.join(timeout=10)
        assert self.process.poll() is None, "".join(self.log)
        return self

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._log_reader.join(timeout=10)


@pytest.fixture
def served_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`fairlane serve --model builtin:tiny` as a real process, killed if a test leaves it running."""
    env = {**os.environ, "FAIRLANE_SHUTDOWN_GRACE_S": "3", "FAIRLANE_KV_CACHE_BYTES": str(4 * 1024 * 1024),
           "FAIRLANE_SWAP_SPACE_BYTES": "0"}
    served = ServedProcess(env)
    try:
        served.wait_ready()
        yield served.process, served.base_url
    finally:
        served.kill()


def is_ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_sigterm_drains_then_exits(served_process: tuple[subprocess.Popen[str], str]) -> None:
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
