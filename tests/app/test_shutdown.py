"""Shutdown: new work gets 503, running streams get the grace period, the rest an error event."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.process.server import CLOSE_TIMEOUT_S
from app.serving.off_loop import THREAD_TOKENIZE_CHARS
from tests.app.conftest import ServerThread, SteppedExecutor, instant_context, stepped_server, wait_for
from tests.app.served_process import ServedProcess
from tests.app.sse import DONE, finish_reasons, sse_frames, sse_payloads

SHUTTING_DOWN_CODE = "server_shutting_down"


def stream_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}


class StreamReader(threading.Thread):
    """Reads one SSE response to its end in the background; `started` is set at the first bytes.
    A connection cut before the body's end is kept in `error`, for the test to fail on."""

    def __init__(self, base_url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.body = body
        self.started = threading.Event()
        self.content = b""
        self.error: httpx.TransportError | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=60) as http, \
                    http.stream("POST", "/v1/completions", json=self.body) as response:
                for chunk in response.iter_bytes():
                    self.content += chunk
                    self.started.set()
        except httpx.TransportError as exc:
            self.error = exc

    def finished_content(self, timeout: float = 30) -> bytes:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        assert self.error is None, f"the connection was cut: {self.error!r}"
        return self.content


def is_draining(base_url: str) -> bool:
    return httpx.get(f"{base_url}/health", timeout=5).status_code == 503


def assert_new_work_refused(base_url: str, model: str) -> None:
    refused = httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": "hi"}, timeout=5)
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, SHUTTING_DOWN_CODE)


def is_shutdown_error(frame: str) -> bool:
    error = json.loads(frame).get("error")
    return error is not None and error["code"] == SHUTTING_DOWN_CODE and "shutting down" in error["message"]


# Long enough for the few requests and the one step the drain test does inside it, on any machine
# that runs the tests; the test waits it out once.
STEPPED_GRACE_S = 3.0
SHORT_TOKENS = 3


def run_one_step(server: ServerThread, executor: SteppedExecutor) -> None:
    """Let one step run and wait until the engine has dispatched its events."""
    num_steps = server.engine.times.steps
    executor.allow(1)
    wait_for(lambda: server.engine.times.steps > num_steps, what="the step to end")


def test_drain_finishes_a_stream_within_the_grace_and_cuts_the_one_still_running_after_it() -> None:
    """Held step by step, so that the outcome does not depend on the machine: at the signal, the
    short stream needs one more step and the long one many; the short one is given its step during
    the grace and finishes normally, the long one is held and gets the error once the grace is over,
    not before."""
    server, executor = stepped_server(shutdown_grace_s=STEPPED_GRACE_S)
    short = StreamReader(server.base_url, stream_body(server.model_name, SHORT_TOKENS))
    long = StreamReader(server.base_url, stream_body(server.model_name, 100))
    try:
        long.start()
        short.start()
        wait_for(lambda: len(server.engine.submitted) == 2, what="both requests to reach the engine")
        short_request = next(r for r in server.engine.submitted if r.max_tokens == SHORT_TOKENS)
        while short_request.num_output_tokens < SHORT_TOKENS - 1:  # unchanged until the next step is let go
            run_one_step(server, executor)

        server.server.request_shutdown()
        signalled = time.monotonic()
        wait_for(lambda: is_draining(server.base_url), what="/health to say draining")
        assert_new_work_refused(server.base_url, server.model_name)
        run_one_step(server, executor)  # the short stream's last token
        short_payloads = sse_payloads(short.finished_content())
        assert server.engine.num_unfinished == 1 and long.is_alive()

        wait_for(lambda: server.engine.num_unfinished == 0, timeout=STEPPED_GRACE_S + 30,
                 what="the drain to end the held stream")
        held_for = time.monotonic() - signalled
    finally:
        executor.open()  # the engine stops only once its held step returns
        server.stop()
    long_frames = sse_frames(long.finished_content())

    assert finish_reasons(short_payloads) == ["length"]
    assert long_frames[-1] == DONE and is_shutdown_error(long_frames[-2])
    assert held_for >= STEPPED_GRACE_S


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


SERVED_GRACE_S = 3


@pytest.fixture
def served_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`fairlane serve --model builtin:tiny` as a real process, killed if a test leaves it running."""
    env = {**os.environ, "FAIRLANE_SHUTDOWN_GRACE_S": str(SERVED_GRACE_S),
           "FAIRLANE_KV_CACHE_BYTES": str(4 * 1024 * 1024), "FAIRLANE_SWAP_SPACE_BYTES": "0"}
    served = ServedProcess(env)
    try:
        served.wait_ready()
        yield served.process, served.base_url
    finally:
        served.kill()


def assert_finished_or_ended_by_shutdown(body: bytes) -> None:
    """A stream in flight at SIGTERM ends one of two ways, which one depending on the machine's
    speed: its normal finish, or the shutting-down error once the grace is over."""
    frames = sse_frames(body)
    assert frames[-1] == DONE and DONE not in frames[:-1], frames[-3:]
    if not is_shutdown_error(frames[-2]):
        assert finish_reasons([json.loads(frame) for frame in frames[:-1]]) == ["length"], frames[-3:]


def test_sigterm_drains_then_exits(served_process: tuple[subprocess.Popen[str], str]) -> None:
    """A real SIGTERM to a real `fairlane serve`. How far the streams get within the grace depends on
    the machine, so only what holds at any speed is asserted here; which stream finishes and which
    is cut is held step by step in the test above. While the 1000-token stream runs (it cannot end
    in the moment between the signal and the first /health poll) the server drains: new work gets
    503. Every stream ends cleanly, and the process exits 0 within the grace and uvicorn's close."""
    process, base_url = served_process
    streams = [StreamReader(base_url, stream_body("builtin:tiny", n)) for n in (1000, 120)]
    for stream in streams:
        stream.start()
        assert stream.started.wait(30)

    process.send_signal(signal.SIGTERM)
    wait_for(lambda: is_draining(base_url), what="/health to say draining")
    assert_new_work_refused(base_url, "builtin:tiny")

    for stream in streams:
        assert_finished_or_ended_by_shutdown(stream.finished_content(timeout=SERVED_GRACE_S + 30))
    assert process.wait(timeout=SERVED_GRACE_S + CLOSE_TIMEOUT_S + 15) == 0


class Poster(threading.Thread):
    """Sends one POST in the background and keeps the response (or the transport error)."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = body
        self.response: httpx.Response | None = None
        self.error: httpx.TransportError | None = None

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=60)
        except httpx.TransportError as exc:
            self.error = exc

    def answer(self) -> httpx.Response:
        self.join(CLOSE_TIMEOUT_S + 30)
        assert self.error is None, f"the connection was cut: {self.error!r}"
        assert self.response is not None, "no answer"
        return self.response


def test_requests_still_waiting_before_the_engine_at_shutdown_get_a_503_in_their_apis_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests of one tenant wait before the engine when the server stops: a long /tokenize held in
    its worker thread, and a long Messages request waiting for the tenant's turn behind it. The drain
    finds the engine idle; uvicorn gives them its close timeout, then cancels them. Each is answered
    as shutting down in its own API's shape (OpenAI's 503, Anthropic's 529), not with a bare 500."""
    server = ServerThread(instant_context()).start()
    tokenizer, off_loop = server.context.tokenizer, server.context.off_loop
    held, release = threading.Event(), threading.Event()
    encode, turn = tokenizer.encode, off_loop._turn
    num_turns = 0

    def held_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        held.set()
        release.wait(CLOSE_TIMEOUT_S + 30)
        return encode(text, *args, **kwargs)

    def counted_turn(tenant_id: str) -> asyncio.Semaphore:
        nonlocal num_turns
        num_turns += 1  # the caller awaits the turn next, with no other await between
        return turn(tenant_id)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    monkeypatch.setattr(off_loop, "_turn", counted_turn)
    long_text = "x" * THREAD_TOKENIZE_CHARS
    tokenize = Poster(f"{server.base_url}/tokenize", {"prompt": long_text})
    messages = Poster(f"{server.base_url}/v1/messages", {
        "model": server.model_name, "max_tokens": 4, "messages": [{"role": "user", "content": long_text}]})
    stopper = threading.Thread(target=server.stop, daemon=True)
    try:
        tokenize.start()
        assert held.wait(30), "the /tokenize job did not start"
        messages.start()
        wait_for(lambda: num_turns == 2, what="the Messages request to wait for the tenant's turn")
        stopper.start()
        answers = tokenize.answer(), messages.answer()
    finally:
        release.set()
        if stopper.ident is None:  # failed before the stop: stop the server all the same
            stopper.start()
        stopper.join(30)

    assert not stopper.is_alive(), "the server did not stop"
    openai, anthropic = answers
    assert (openai.status_code, openai.json()["error"]["code"]) == (503, SHUTTING_DOWN_CODE)
    assert openai.headers["retry-after"]
    assert anthropic.status_code == 529
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "overloaded_error"
    assert "shutting down" in anthropic.json()["error"]["message"]
