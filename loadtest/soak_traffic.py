"""The soak's traffic: closed-loop users, each drawing its next request from a mix of what a real
server sees (streamed chats of both classes, clients that leave mid-stream, non-streamed
completions, structured outputs, n > 1, Batch API jobs, some of them cancelled).

Every request is recorded as a RequestRecord whose `klass` is its kind, so a report can group by
kind and by time window. A kind's outcome is the client's view: "ok", "dropped", an HTTP status or a
client-side failure (loadtest.client).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.batch_job import run_batch_job, run_cancelled_batch_job
from loadtest.client import OK, RequestRecord, send_chat, take_refusal, take_transport_failure
from loadtest.workload import (
    BATCH,
    BATCH_API,
    INTERACTIVE,
    ChatRequest,
    LoadTenant,
    batch_request,
    chat_request,
    disconnect_request,
)

CHAT = "chat"  # streamed, interactive: the latency windows are its TTFT
FLEX_CHAT = "flex-chat"  # streamed, batch class: the work interactive requests preempt
DISCONNECT = "disconnect"  # streamed, the client leaves after a few chunks
COMPLETION = "completion"  # /v1/completions, not streamed
STRUCTURED = "structured"  # chat with a JSON schema, not streamed
MULTI = "n2"  # chat with n = 2, not streamed
BATCH_JOB = "batch-job"  # a Batch API job of a few items, run to its end
CANCELLED_BATCH = "batch-cancelled"  # a Batch API job cancelled while it runs

# How often each kind is drawn: mostly interactive chats, with every other kind present throughout.
MIX: dict[str, float] = {CHAT: 40, FLEX_CHAT: 15, DISCONNECT: 10, COMPLETION: 10, STRUCTURED: 8, MULTI: 7,
                         BATCH_JOB: 5, CANCELLED_BATCH: 5}
# The priority class each kind runs in: flex-tier chats and Batch API items are batch-class.
KIND_CLASS: dict[str, str] = {CHAT: INTERACTIVE, FLEX_CHAT: BATCH, DISCONNECT: INTERACTIVE, COMPLETION: INTERACTIVE,
                              STRUCTURED: INTERACTIVE, MULTI: INTERACTIVE, BATCH_JOB: BATCH, CANCELLED_BATCH: BATCH}
NUM_BATCH_ITEMS = 3
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["answer", "score"]}}}


@dataclass(slots=True)
class Traffic:
    """What the users share: the HTTP client, the clock, the records, whether to keep sending."""

    http: httpx.AsyncClient
    model: str
    start: float
    records: list[RequestRecord] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    is_sending: bool = True

    def now(self) -> float:
        return time.perf_counter() - self.start

    def record(self, tenant: LoadTenant, kind: str) -> RequestRecord:
        record = RequestRecord(tenant.tenant_id, kind, self.now())
        self.records.append(record)
        return record



async def post_once(traffic: Traffic, path: str, body: dict[str, Any], tenant: LoadTenant,
                    record: RequestRecord) -> None:
    """One non-streamed request: its outcome, end-to-end time and usage."""
    try:
        response = await traffic.http.post(path, json=body, headers=tenant.headers)
        record.take_head(response)
        record.num_bytes = len(response.content)
        if response.status_code != 200:
            take_refusal(record, response)
            return
        answer = response.json()
        record.outcome, record.completion_id = OK, answer.get("id")
        usage = answer.get("usage") or {}
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))
        record.chunk_times = [traffic.now()]
    except httpx.RequestError as exc:
        take_transport_failure(record, exc)
    finally:
        record.e2e_s = traffic.now() - record.sent_at


def _chat_body(traffic: Traffic, request: ChatRequest, **extra: Any) -> dict[str, Any]:
    return request.body(traffic.model, stream=False) | extra


async def send_kind(traffic: Traffic, kind: str, tenant: LoadTenant, rng: random.Random) -> None:
    """Send one request of this kind and wait for its end."""
    await SENDERS[kind](traffic, tenant, rng)


async def _streamed(traffic: Traffic, kind: str, request: ChatRequest) -> None:
    await send_chat(traffic.http, traffic.model, request, traffic.record(request.tenant, kind), traffic.now)


async def _chat(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    await _streamed(traffic, CHAT, chat_request(tenant, rng))


async def _flex_chat(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    await _streamed(traffic, FLEX_CHAT, batch_request(tenant, rng))


async def _disconnect(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    await _streamed(traffic, DISCONNECT, disconnect_request(tenant, rng, drop_share=1.0))


async def _completion(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    request = chat_request(tenant, rng)
    body = {"model": traffic.model, "prompt": request.messages[0][1], "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True}
    await post_once(traffic, "/v1/completions", body, tenant, traffic.record(tenant, COMPLETION))


async def _structured(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    body = _chat_body(traffic, chat_request(tenant, rng), response_format=SCHEMA_FORMAT, ignore_eos=False)
    await post_once(traffic, "/v1/chat/completions", body, tenant, traffic.record(tenant, STRUCTURED))


async def _multi(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    body = _chat_body(traffic, chat_request(tenant, rng), n=2, temperature=0.8, seed=rng.randrange(1 << 30))
    await post_once(traffic, "/v1/chat/completions", body, tenant, traffic.record(tenant, MULTI))


def _batch_items(tenant: LoadTenant, rng: random.Random) -> list[ChatRequest]:
    return [batch_request(tenant, rng, BATCH_API) for _ in range(NUM_BATCH_ITEMS)]


async def _batch_job(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    items = _batch_items(tenant, rng)
    records = [traffic.record(tenant, BATCH_JOB) for _ in items]
    await run_batch_job(traffic.http, traffic.model, items, records, traffic.now, traffic.batches)


async def _cancelled_batch(traffic: Traffic, tenant: LoadTenant, rng: random.Random) -> None:
    items = _batch_items(tenant, rng)
    record = traffic.record(tenant, CANCELLED_BATCH)
    await run_cancelled_batch_job(traffic.http, traffic.model, items, record, traffic.now, traffic.batches,
                                  cancel_after_s=rng.uniform(0.2, 2.0))


SENDERS: dict[str, Callable[[Traffic, LoadTenant, random.Random], Awaitable[None]]] = {
    CHAT: _chat, FLEX_CHAT: _flex_chat, DISCONNECT: _disconnect, COMPLETION: _completion,
    STRUCTURED: _structured, MULTI: _multi, BATCH_JOB: _batch_job, CANCELLED_BATCH: _cancelled_batch,
}


async def user(traffic: Traffic, tenant: LoadTenant, rng: random.Random, think_s: float,
               first_kinds: Sequence[str] = ()) -> None:
    """One closed-loop user: a request, a think time, the next, until the traffic stops. It sends
    `first_kinds` first, in order, then draws each request's kind by MIX's weights: users that share the
    kinds out between them send every kind early, however few requests a short or slow run allows."""
    kinds, weights = list(MIX), list(MIX.values())
    planned = iter(first_kinds)
    while traffic.is_sending:
        await send_kind(traffic, next(planned, None) or rng.choices(kinds, weights)[0], tenant, rng)
        await asyncio.sleep(rng.expovariate(1 / think_s) if think_s > 0 else 0)
