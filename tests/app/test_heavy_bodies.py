"""No request holds the event loop every tenant's streams run on: a body of 100,000 items is parsed,
validated, translated and rendered in a worker thread, on each surface, and `truncation: auto` finds
what fits in a few renders, not one per dropped turn.

The event loop's own lag is what is measured: a task on the server's loop that sleeps 2 ms at a time
and notes the longest wait between two wake-ups, while one heavy body is served. On the loop, such a
body held it 0.3-1.6 s here (a whole second for the Responses API, 1.6 s for truncation); off it,
under 0.1 s. Collection is paced as `fairlane serve` paces it (`paced_collection`): otherwise a full
collection of the test process's heap, which is not the server's, would be most of the lag.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.serving.off_loop import PREPARE_NICE, OffLoop
from scheduling.gc_pacing import paced_collection
from tests.app.conftest import ServerThread, instant_context

MiB = 1024 * 1024
NUM_ITEMS = 100_000  # about 3.7 MB of JSON: under the default 4 MiB body limit
WORST_LOOP_LAG_S = 0.3
# Decoding the body's JSON is one call that holds the interpreter lock throughout, wherever it runs: the
# loop waits it out. On a slow 2-vCPU EPYC beside the suite's other worker it took 0.1-0.15 s, and the
# loop's lag off-loop reached 0.33-0.37 s; on the loop, the lag was 7-40 decodes' worth.
LAG_IN_BODY_DECODES = 4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    context = instant_context(max_body_bytes=4 * MiB)
    # At normal priority: what is measured is whether the work leaves the loop. Its threads' low priority
    # is tested below; beside the suite's other worker, a low-priority thread holding the interpreter lock
    # could be kept off the CPU for a while, which is a matter of CPU shares, not of the loop.
    context.off_loop = OffLoop(nice=0)
    with paced_collection():
        started = ServerThread(context).start()
        yield started
        started.stop()


class LoopLag:
    """The longest the server's event loop went without running a 2 ms sleeper, while inside `with`."""

    def __init__(self, server: ServerThread) -> None:
        assert server.server.loop is not None
        self.loop = server.server.loop
        self.stop = asyncio.Event()
        self.worst_s = 0.0

    async def _watch(self) -> float:
        worst, last = 0.0, time.perf_counter()
        while not self.stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        return worst

    def __enter__(self) -> LoopLag:
        self.watching = asyncio.run_coroutine_threadsafe(self._watch(), self.loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.worst_s = self.watching.result(timeout=10)


def worst_loop_lag_s(content: str) -> float:
    """The bound on the loop's lag: 0.3 s, or a few decodes of the body where decoding it alone is slower."""
    started = time.perf_counter()
    json.loads(content)
    return max(WORST_LOOP_LAG_S, LAG_IN_BODY_DECODES * (time.perf_counter() - started))


def _messages(count: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"hi {i}"} for i in range(count)]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses", {"input": _messages(NUM_ITEMS)}),
    ("/v1/chat/completions", {"messages": _messages(NUM_ITEMS), "max_tokens": 1}),
    ("/v1/messages", {"messages": _messages(NUM_ITEMS), "max_tokens": 1}),
], ids=["responses", "chat", "anthropic"])
def test_a_body_of_many_items_does_not_hold_the_event_loop(server: ServerThread, path: str,
                                                           body: dict[str, Any]) -> None:
    # Encoded before the watch: the client runs in this process, and the C encoder holds the interpreter
    # lock for the whole body (0.3 s on a slow 2-vCPU EPYC), which the server's loop would wait out.
    content = json.dumps({"model": server.model_name, **body})
    worst_lag_s = worst_loop_lag_s(content)
    with LoopLag(server) as lag:
        response = httpx.post(f"{server.base_url}{path}", content=content, timeout=60,
                              headers={"content-type": "application/json"})
    assert response.status_code == 400  # far longer than the model's context: refused, with the numbers
    assert "tokens" in response.text
    assert lag.worst_s < worst_lag_s, f"the event loop stalled {lag.worst_s:.3f} s (bound {worst_lag_s:.3f} s)"


def test_truncation_finds_what_fits_in_a_few_renders(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    turns: list[dict[str, Any]] = []
    for i in range(3000):
        turns += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    turns.append({"role": "user", "content": "and the last one?"})
    tokenizer = server.context.tokenizer
    renders: list[int] = []

    def counted(messages: Any, tools: Any = None) -> list[int]:
        renders.append(len(messages))
        return type(tokenizer).encode_chat(tokenizer, messages, tools)

    monkeypatch.setattr(tokenizer, "encode_chat", counted)
    body = {"model": server.model_name, "input": turns, "truncation": "auto", "max_output_tokens": 4}
    content = json.dumps(body)
    worst_lag_s = worst_loop_lag_s(content)
    with LoopLag(server) as lag:
        response = httpx.post(f"{server.base_url}/v1/responses", content=content, timeout=60,
                              headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    max_model_len = server.context.geometry.max_model_len
    assert usage["input_tokens"] + 4 <= max_model_len
    assert len(renders) <= 16  # halving over 6,000 turns; one turn at a time rendered 5,900 times
    # The fewest turns were dropped: one more turn (a question and its answer, ~30 tokens) would not fit.
    assert usage["input_tokens"] + 4 > max_model_len - 40
    assert lag.worst_s < worst_lag_s, f"the event loop stalled {lag.worst_s:.3f} s (bound {worst_lag_s:.3f} s)"


def test_heavy_work_runs_at_a_low_priority_one_job_per_tenant_at_a_time() -> None:
    """Behind the engine for the CPU; and a tenant's second heavy job waits for its first."""
    off_loop = OffLoop(num_threads=2)
    running: list[str] = []
    most_at_once: dict[str, int] = {}

    def job(tenant: str) -> int:
        running.append(tenant)
        most_at_once[tenant] = max(most_at_once.get(tenant, 0), running.count(tenant))
        time.sleep(0.02)  # the job's work: long enough that a second job of its tenant, if let in, would overlap it
        running.remove(tenant)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def storm() -> list[int]:
        return await asyncio.gather(*(off_loop.run_if(True, tenant, job, tenant) for tenant in ["a"] * 4 + ["b"]))

    try:
        niceness = asyncio.run(storm())
    finally:
        off_loop.close()
    assert set(niceness) == {PREPARE_NICE}
    assert most_at_once == {"a": 1, "b": 1}


def test_a_tenants_heavy_jobs_take_at_most_their_share_of_a_core() -> None:
    """After a job of c CPU seconds, the tenant's next heavy job waits c * (1 / share - 1); the job's own
    result comes back at once, and another tenant's job waits for none of it."""
    off_loop = OffLoop(num_threads=2, nice=0, cpu_share=0.25)  # a pause of three times the job's CPU time
    spans: dict[str, list[tuple[float, float, float]]] = {"a": [], "b": []}  # (start, end, cpu seconds)

    def burn(tenant: str) -> float:
        start, cpu_start = time.monotonic(), time.thread_time()
        while time.thread_time() - cpu_start < 0.03:
            pass
        spans[tenant].append((start, time.monotonic(), time.thread_time() - cpu_start))
        return time.monotonic()

    async def jobs() -> tuple[list[float], float]:
        first = await off_loop.run_if(True, "a", burn, "a")
        returned = time.monotonic()
        rest = await asyncio.gather(off_loop.run_if(True, "a", burn, "a"), off_loop.run_if(True, "b", burn, "b"))
        return [first, *rest], returned

    try:
        (first_end, _, _), returned = asyncio.run(jobs())
    finally:
        off_loop.close()
    (_, a_end, a_cpu), (a_next_start, _, _) = spans["a"]
    b_start = spans["b"][0][0]
    assert returned - first_end < 0.05  # the result did not wait for the pause
    assert a_next_start - a_end >= 3 * a_cpu * 0.95  # the tenant's next job did
    assert b_start - a_end < 3 * a_cpu * 0.5  # another tenant's did not
