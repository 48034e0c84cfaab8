"""A large batch must not stall the server: creating and cancelling 60,000 items while another client
streams keeps every event-loop wakeup and every SSE chunk within a second."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import httpx
import openai
import pytest

from tests.app.conftest import ServerThread, instant_context, wait_for
from tests.app.test_batch_api import KEYS, item, jsonl, tenants_file, wait_for_status

__all__ = ["tenants_file"]  # a fixture, imported to be used here

NUM_LINES = 60_000
PROBE_INTERVAL_S = 0.01
MAX_STALL_S = 1.0


class LoopProbe:
    """On the server's own loop: how late does a 10 ms sleep wake up, at worst?"""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.max_lateness_s = 0.0
        self._is_stopping = False
        self._done: Future[None] = asyncio.run_coroutine_threadsafe(self._watch(), loop)

    async def _watch(self) -> None:
        while not self._is_stopping:
            before = self.loop.time()
            await asyncio.sleep(PROBE_INTERVAL_S)
            self.max_lateness_s = max(self.max_lateness_s, self.loop.time() - before - PROBE_INTERVAL_S)

    def stop(self) -> float:
        self._is_stopping = True
        self._done.result(timeout=10)
        return self.max_lateness_s


class Streamer:
    """Another connection: chat streams one after another, noting the longest wait for the next chunk."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url = base_url
        self.model = model
        self.max_gap_s = 0.0
        self.num_streams = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-streamer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": 400,
                "messages": [{"role": "user", "content": "Tell a long story."}]}
        with httpx.Client(base_url=self.base_url, headers={"authorization": f"Bearer {KEYS['bob']}"},
                          timeout=600) as client:
            while not self._stop.is_set():
                last = time.monotonic()
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    for _ in response.iter_lines():
                        now = time.monotonic()
                        self.max_gap_s, last = max(self.max_gap_s, now - last), now
                self.num_streams += 1

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        return self.max_gap_s


@pytest.fixture
def server(tenants_file: Path) -> Iterator[ServerThread]:
    started = ServerThread(instant_context(tenants_file=str(tenants_file), batch_poll_s=0.05)).start()
    yield started
    started.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_creating_and_cancelling_a_huge_batch_never_stalls_the_loop(server: ServerThread) -> None:
    # Generous client timeouts: on a stalled server the test must still finish and report the stall.
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS["alice"], max_retries=0, timeout=600)
    content = jsonl([item(f"x{i}", server.model_name) for i in range(NUM_LINES)])
    loop = server.server._loop
    assert loop is not None
    gc.collect()  # the test's own garbage (it shares the process) must not pause the loop being measured
    probe = LoopProbe(loop)
    streamer = Streamer(server.base_url, server.model_name)
    wait_for(lambda: streamer.num_streams >= 1, timeout=30, what="a first stream to finish")
    started = time.monotonic()
    try:
        file_id = client.files.create(file=("huge.jsonl", content), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = wait_for_status(client, batch.id, ("cancelled",), timeout=600)
    finally:
        elapsed_s = time.monotonic() - started
        max_gap_s, max_lateness_s = streamer.stop(), probe.stop()
    print(f"\nupload+create+cancel {elapsed_s:.1f} s; loop lateness max {max_lateness_s * 1000:.0f} ms; "
          f"SSE gap max {max_gap_s * 1000:.0f} ms")
    assert done.request_counts is not None and done.request_counts.total == NUM_LINES
    assert max_lateness_s < MAX_STALL_S and max_gap_s < MAX_STALL_S
