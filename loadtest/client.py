"""The client side of a load test: one streamed chat request timed as its user feels it, the SSE
parser, and the server's /stats read before and after (the leak check).

Times are seconds after the run's start (one `time.perf_counter` origin for every request).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from loadtest.workload import ChatRequest, LoadTenant

OK = "ok"
DROPPED = "dropped"  # the client left mid-stream on purpose (the disconnect scenario): not an error
UNFINISHED = "unfinished"  # still going when the run's drain timeout ended it
TIMEOUT = "timeout"
TRANSPORT_ERROR = "transport_error"
STREAM_ERROR = "stream_error"  # an error event after the stream started
BAD_STREAM = "bad_stream"  # the stream ended without `data: [DONE]`, or a chunk was not one (reasons below)
NOT_ERRORS = frozenset({OK, DROPPED})
# Why a request did not end ok (RequestRecord.reason); a timeout or transport error gives its exception's class.
NO_DONE = "closed without [DONE]"  # the body ended cleanly, but before its last event
NOT_JSON = "chunk not JSON"  # detail: the chunk
NOT_A_CHUNK = "chunk not a chunk"  # JSON, but not an object of a chunk's shape; detail: the chunk
ERROR_EVENT = "error event"  # detail: its message
ERROR_RESPONSE = "error response"  # a status other than 200; detail: the body's error message
DETAIL_CHARS = 200
DONE = "[DONE]"
STATS_PATH = "/stats"
SSE_LINE_END = re.compile(rb"\r\n|\r|\n")  # the only line ends of an event stream


@dataclass(slots=True)
class RequestRecord:
    """What one request looked like from the client. Updated as the response arrives, so a request
    cancelled at the end of the run still shows what it had received."""

    tenant: str
    klass: str
    sent_at: float
    outcome: str = UNFINISHED  # OK, DROPPED, an HTTP status ("429") or one of the client-side kinds above
    ttft_s: float | None = None  # to the first chunk with content
    e2e_s: float | None = None  # to the end of the response (or the drop)
    chunk_times: list[float] = field(default_factory=list)  # when each content chunk arrived
    prompt_tokens: int = 0
    completion_tokens: int = 0  # from usage; the number of content chunks when no usage arrived
    cached_tokens: int = 0
    retry_after: str | None = None  # the Retry-After header of a refusal (429, 503), when it had one
    status: int | None = None  # the HTTP status; None when no response head arrived
    request_id: str | None = None  # the response's x-request-id
    completion_id: str | None = None  # the `id` its chunks or body carry: what the server's request log names
    num_events: int = 0  # SSE events read, [DONE] included
    num_bytes: int = 0  # body bytes read
    reason: str | None = None  # why it did not end ok: one of the reasons above, or an exception's class
    detail: str | None = None  # what the reason is about (the chunk, a message), cut to DETAIL_CHARS

    @property
    def is_error(self) -> bool:
        return self.outcome not in NOT_ERRORS

    def fail(self, outcome: str, reason: str, detail: str | None = None) -> None:
        """End the record as not ok, saying why."""
        self.outcome, self.reason = outcome, reason
        self.detail = None if detail is None else detail[:DETAIL_CHARS]

    def take_head(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.request_id = response.headers.get("x-request-id")

    def failure_json(self) -> dict[str, Any]:
        """What the client knew of a request that did not end ok, for a report's list of them."""
        return {"tenant": self.tenant, "sent_at_s": round(self.sent_at, 3),
                "elapsed_s": None if self.e2e_s is None else round(self.e2e_s, 3), "status": self.status,
                "outcome": self.outcome, "reason": self.reason, "detail": self.detail, "request_id": self.request_id,
                "completion_id": self.completion_id, "num_events": self.num_events,
                "num_content_chunks": len(self.chunk_times), "num_bytes": self.num_bytes}

    @property
    def ended_at(self) -> float:
        return self.sent_at + self.e2e_s if self.e2e_s is not None else max(self.chunk_times, default=self.sent_at)


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def sse_lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream read in pieces cut anywhere, split where SSE ends a line: at CRLF,
    LF or CR, and nowhere else. Not httpx's `aiter_lines`: it splits like `str.splitlines`, also at
    U+0085, U+2028 and U+2029, which JSON carries unescaped (the server's orjson does), so a chunk
    whose text held one was cut in two and read as JSON that is not."""
    pending = b""
    async for piece in pieces:
        pending += piece
        # A CR at the end may be the first half of a CRLF: it waits for the next piece.
        cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        *lines, rest = SSE_LINE_END.split(pending[:cut])
        pending = rest + pending[cut:]
        for line in lines:  # UTF-8 never has a CR or LF byte inside a character: each line decodes whole
            yield line.decode("utf-8", errors="replace")
    if pending:
        *lines, rest = SSE_LINE_END.split(pending)
        for line in [*lines, rest] if rest else lines:
            yield line.decode("utf-8", errors="replace")


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event: `data:` lines joined, comment lines (':') skipped, an
    event ended by a blank line."""
    data: list[str] = []
    async for line in lines:
        if line.startswith(":"):
            continue
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


Clock = Callable[[], float]


def take_refusal(record: RequestRecord, response: httpx.Response) -> None:
    """An answer other than 200, its body read: the status is the outcome, the body's message the detail."""
    record.take_head(response)
    record.retry_after = response.headers.get("retry-after")
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):  # not OpenAI's error shape: the body as it came
        message = response.text
    record.fail(str(response.status_code), ERROR_RESPONSE, message)


def take_transport_failure(record: RequestRecord, exc: httpx.RequestError) -> None:
    """A timeout or transport error (or a body httpx could not decode) ended the request; the exception
    is its reason."""
    outcome = TIMEOUT if isinstance(exc, httpx.TimeoutException) else TRANSPORT_ERROR
    record.fail(outcome, type(exc).__name__, str(exc))


async def send_chat(http: httpx.AsyncClient, model: str, request: ChatRequest, record: RequestRecord,
                    clock: Clock) -> None:
    """Stream one chat completion into record. Never raises for what the server or network does:
    that becomes the record's outcome."""
    try:
        async with http.stream("POST", "/v1/chat/completions", json=request.body(model),
                               headers=request.tenant.headers) as response:
            record.take_head(response)
            if response.status_code != 200:
                await response.aread()
                record.num_bytes = len(response.content)
                take_refusal(record, response)
            else:
                await _read_stream(response, request, record, clock)
    except httpx.RequestError as exc:
        take_transport_failure(record, exc)
    finally:
        if record.outcome != UNFINISHED:
            record.e2e_s = clock() - record.sent_at
        if not record.completion_tokens:
            record.completion_tokens = len(record.chunk_times)


async def _read_stream(response: httpx.Response, request: ChatRequest, record: RequestRecord, clock: Clock) -> None:
    """Read events until the stream is over for this client; the record's outcome says how it ended."""
    async for data in sse_data(sse_lines(_counted(response.aiter_bytes(), record))):
        record.num_events += 1
        if data == DONE:
            record.outcome = OK
            return
        if not _take_event(data, record, clock()):
            return
        if request.drop_after_chunks is not None and len(record.chunk_times) >= request.drop_after_chunks:
            record.outcome = DROPPED  # leaving the `async with` closes the connection mid-stream
            return
    record.fail(BAD_STREAM, NO_DONE)


async def _counted(pieces: AsyncIterator[bytes], record: RequestRecord) -> AsyncIterator[bytes]:
    async for piece in pieces:
        record.num_bytes += len(piece)
        yield piece


def _take_event(data: str, record: RequestRecord, now: float) -> bool:
    """Take one event's chunk into record: True while the stream goes on, False once the event failed it."""
    try:
        chunk = json.loads(data)
    except ValueError:
        record.fail(BAD_STREAM, NOT_JSON, data)
        return False
    if not isinstance(chunk, dict):
        record.fail(BAD_STREAM, NOT_A_CHUNK, data)
        return False
    if "error" in chunk:
        error = chunk["error"]
        record.fail(STREAM_ERROR, ERROR_EVENT, str(error.get("message") if isinstance(error, dict) else error))
        return False
    record.completion_id = record.completion_id or chunk.get("id")
    try:
        has_content = _take_chunk(chunk, record, now - record.sent_at)
    except (ValueError, TypeError, AttributeError):  # usage or choices of another shape
        record.fail(BAD_STREAM, NOT_A_CHUNK, data)
        return False
    if has_content:
        record.chunk_times.append(now)
    return True


def _take_chunk(chunk: dict[str, Any], record: RequestRecord, elapsed: float) -> bool:
    """Note usage and the first token; True when the chunk carries content."""
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))
        record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    choices = chunk.get("choices") or []
    has_content = bool(choices and (choices[0].get("delta") or {}).get("content"))
    if has_content and record.ttft_s is None:
        record.ttft_s = elapsed
    return has_content


async def served_model(http: httpx.AsyncClient, tenant: LoadTenant) -> str:
    response = await http.get("/v1/models", headers=tenant.headers)
    response.raise_for_status()
    model: str = response.json()["data"][0]["id"]
    return model


async def read_stats(http: httpx.AsyncClient, admin_key: str | None = None) -> dict[str, Any]:
    """The server's /stats; with tenants configured it takes the operator key (`[admin]`)."""
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else None
    response = await http.get(STATS_PATH, headers=headers)
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


@dataclass(slots=True)
class SettleResult:
    """The leak check: once the load has ended, the server must come back to idle by itself."""

    passed: bool
    waited_s: float
    problems: list[str]
    stats: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "waited_s": round(self.waited_s, 3), "problems": self.problems,
                "stats": self.stats}


def idle_problems(stats: dict[str, Any]) -> list[str]:
    """What is wrong with a server that should have nothing left to do; empty when all is well."""
    problems = [f"{stats[k]} request(s) still {k} (stuck)" for k in ("running", "waiting", "swapped") if stats.get(k)]
    if problems:
        return problems  # blocks held by requests that still exist are theirs, not leaked
    if stats.get("kv_blocks_in_use"):
        problems.append(f"{stats['kv_blocks_in_use']} of {stats.get('kv_blocks_total', '?')} KV blocks still in use"
                        " (leaked)")
    if stats.get("cpu_blocks_in_use"):
        problems.append(f"{stats['cpu_blocks_in_use']} CPU swap blocks still in use (leaked)")
    return problems


async def settle(http: httpx.AsyncClient, timeout_s: float, interval_s: float = 0.2,
                 admin_key: str | None = None) -> SettleResult:
    """Poll /stats until the server is idle with every KV block free, or timeout_s has passed.
    Assumes the load tool is the server's only client while it runs."""
    start = time.perf_counter()
    while True:
        try:
            stats = await read_stats(http, admin_key)
            problems = idle_problems(stats)
        except (httpx.HTTPError, ValueError) as exc:
            stats, problems = {}, [f"/stats could not be read: {exc!r}"]
        waited = time.perf_counter() - start
        if not problems or waited >= timeout_s:
            if problems:
                problems = [f"after {waited:.1f} s: {p}" for p in problems]
            return SettleResult(not problems, waited, problems, stats)
        await asyncio.sleep(interval_s)
