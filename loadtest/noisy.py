"""`python -m loadtest noisy-neighbour`: a light tenant's latency with and without a neighbour that
abuses everything tenants share.

Two phases against one server, the light tenant (the tenants file's first) doing the same in each:
`light_clients` closed-loop streamed chats and, at the start, a small Batch API job.
1. alone: only the light tenant;
2. beside the neighbour (the file's second tenant), which meanwhile runs every abuse at once:
   a large batch sent first, a batch of poison lines (bodies that can never run), big uploads read
   back and deleted, a /tokenize storm of long texts, Responses bodies of many thousand items, a
   background response re-attached to by many readers at once, and chats pinning long prefixes in
   the cache (`cache_control` with a TTL).
The report holds the light tenant's TTFT and ITL (p50, p99) and its batch's completion time per
phase, their ratios, what each abuse did (by status), and every 5xx answered to anyone. It passes
when every ratio is within `max_ratio` and nothing got a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import multiprocessing
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

from loadtest.batch_job import run_batch_job
from loadtest.client import RequestRecord, send_chat, served_model
from loadtest.stats import percentile
from loadtest.workload import BATCH_API, LoadTenant, batch_request, chat_request, prompt_text

ALONE = "alone"
ABUSES = ("large-batch", "poison-batch", "uploads", "tokenize", "heavy-bodies", "reattach", "pins")
NEIGHBOUR = "with_neighbour"
MIB = 1024 * 1024
ABUSE_GRACE_S = 10.0  # after the phase, what an abuse still waits for is waited for this long at most


@dataclass(slots=True, frozen=True)
class NoisyConfig:
    url: str
    tenants: tuple[LoadTenant, ...]  # the light tenant, then the neighbour
    phase_s: float = 60.0  # each phase's chat traffic lasts this long
    light_clients: int = 2
    light_batch_items: int = 8
    neighbour_batch_items: int = 200
    poison_lines: int = 20
    upload_bytes: int = 16 * MIB
    tokenize_chars: int = 1 * MIB
    storm_workers: int = 4  # concurrent loops of each storm (tokenize, re-attach)
    heavy_items: int = 50_000  # items of the neighbour's Responses bodies
    pin_words: int = 400  # words of each prefix the neighbour pins
    max_ratio: float = 1.3
    seed: int = 0
    abuses: tuple[str, ...] = ()  # the neighbour's abuses by name (ABUSES); empty: all of them
    warmup_chats: int = 4
    request_timeout_s: float = 300.0

    def check(self) -> None:
        if len(self.tenants) < 2:
            raise ValueError("the noisy-neighbour run needs a tenants file with two tenants: the light one, then "
                             "the neighbour")
        if self.phase_s <= 0 or self.light_clients < 1 or self.light_batch_items < 1:
            raise ValueError("the phase, the light clients and its batch must be positive")
        unknown = set(self.abuses) - set(ABUSES)
        if unknown:
            raise ValueError(f"unknown abuses {sorted(unknown)}; choose from {', '.join(ABUSES)}")

    @property
    def light(self) -> LoadTenant:
        return self.tenants[0]

    @property
    def neighbour(self) -> LoadTenant:
        return self.tenants[1]


@dataclass(slots=True)
class PhaseResult:
    name: str
    chats: list[RequestRecord] = field(default_factory=list)
    batch: list[dict[str, Any]] = field(default_factory=list)  # the light tenant's batch summary
    abuses: dict[str, Counter[str]] = field(default_factory=dict)  # abuse -> outcome ("200", "429"...) -> count
    server_errors: list[str] = field(default_factory=list)  # "who what: status" of every 5xx


@dataclass(slots=True)
class NoisyResult:
    config: NoisyConfig
    model: str
    phases: list[PhaseResult]


class Phase:
    """One phase's clock, its deadline and what it saw."""

    def __init__(self, config: NoisyConfig, http: httpx.AsyncClient, model: str, name: str) -> None:
        self.config, self.http, self.model = config, http, model
        self.result = PhaseResult(name)
        self._start = time.perf_counter()

    def reset_clock(self) -> None:
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    @property
    def is_open(self) -> bool:
        return self.now() < self.config.phase_s

    def note(self, abuse: str, status: int | str) -> None:
        self.result.abuses.setdefault(abuse, Counter())[str(status)] += 1
        if isinstance(status, int) and status >= 500:
            self.result.server_errors.append(f"{abuse}: {status}")

    async def light_chats(self, rng: random.Random) -> None:
        """One closed-loop user of the light tenant: a streamed chat at a time until the phase ends."""
        while self.is_open:
            request = chat_request(self.config.light, rng)
            record = RequestRecord(self.config.light.tenant_id, request.klass, self.now())
            self.result.chats.append(record)
            await send_chat(self.http, self.model, request, record, self.now)
            if record.status is not None and record.status >= 500:
                self.result.server_errors.append(f"light chat: {record.status}")

    async def light_batch(self, rng: random.Random) -> None:
        items = [batch_request(self.config.light, rng, BATCH_API) for _ in range(self.config.light_batch_items)]
        records = [RequestRecord(self.config.light.tenant_id, BATCH_API, self.now()) for _ in items]
        await run_batch_job(self.http, self.model, items, records, self.now, self.result.batch)


async def run_noisy(config: NoisyConfig) -> NoisyResult:
    config.check()
    async with _client(config) as http:
        model = await served_model(http, config.light)
        await _warm_up(config, http, model)
        phases = [await _run_phase(config, http, model, ALONE), await _run_phase(config, http, model, NEIGHBOUR)]
    return NoisyResult(config, model, phases)


def _client(config: NoisyConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=limits)


async def _warm_up(config: NoisyConfig, http: httpx.AsyncClient, model: str) -> None:
    """A few of the light tenant's chats, not counted: the first phase is not to pay for a cold server."""
    rng = random.Random(f"{config.seed}/warm-up")
    for _ in range(config.warmup_chats):
        record = RequestRecord(config.light.tenant_id, "warm-up", 0.0)
        await send_chat(http, model, chat_request(config.light, rng), record, time.perf_counter)


async def _run_phase(config: NoisyConfig, http: httpx.AsyncClient, model: str, name: str) -> PhaseResult:
    """The light tenant's traffic, beside the neighbour's abuses in the second phase. The neighbour runs in
    a process of its own, as another tenant's client would: building its bodies (a 50,000-item JSON
    document, 16 MiB uploads) on this event loop held the light tenant's streams unread, and its gaps read
    the client's stalls as the server's."""
    phase = Phase(config, http, model, name)
    rng = random.Random(f"{config.seed}/noisy")  # the light tenant's traffic is the same in both phases
    light = [phase.light_batch(rng), *(phase.light_chats(random.Random(f"{config.seed}/chat/{i}"))
                                       for i in range(config.light_clients))]
    if name != NEIGHBOUR:
        await asyncio.gather(*light)
        return phase.result
    with NeighbourProcess(config, model) as neighbour:
        await neighbour.started()
        phase.reset_clock()
        await asyncio.gather(*light)
        abuses, server_errors = await neighbour.result()
    phase.result.abuses.update(abuses)
    phase.result.server_errors.extend(server_errors)
    return phase.result


class NeighbourProcess:
    """The neighbour's abuses in a spawned process; `started` once its client is ready and its phase has
    begun, `result` (what each abuse got back, and every 5xx) once told the light tenant is done."""

    def __init__(self, config: NoisyConfig, model: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_neighbour_main, args=(config, model, child), daemon=True)

    def __enter__(self) -> NeighbourProcess:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.join(timeout=ABUSE_GRACE_S)
        if self._process.is_alive():
            self._process.kill()

    async def started(self) -> None:
        await asyncio.to_thread(self._conn.recv)

    async def result(self) -> tuple[dict[str, Counter[str]], list[str]]:
        self._conn.send("stop")
        abuses, server_errors = await asyncio.to_thread(self._conn.recv)
        return abuses, server_errors


def _neighbour_main(config: NoisyConfig, model: str, conn: Connection) -> None:
    result = asyncio.run(_run_neighbour(config, model, conn))
    conn.send((result.abuses, result.server_errors))


async def _run_neighbour(config: NoisyConfig, model: str, conn: Connection) -> PhaseResult:
    """Every abuse until the phase closes and the light tenant is done (told by "stop"): each looping abuse
    ends with the answer it waits for (a heavy body's, prepared at a low priority, can take seconds on a
    busy 2-core machine), and what is still running after ABUSE_GRACE_S (the large batch, most likely) is
    cancelled."""
    async with _client(config) as http:
        phase = Phase(config, http, model, NEIGHBOUR)
        tasks = [asyncio.create_task(abuse) for abuse in Neighbour(phase).abuses()]
        conn.send("started")
        await asyncio.to_thread(conn.recv)
        await asyncio.wait(tasks, timeout=ABUSE_GRACE_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return phase.result


class Neighbour:
    """The second tenant, taking all it can of what tenants share; each abuse loops until the phase
    ends (or is cancelled), noting each answer's status."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase
        self.http = phase.http
        self.tenant = phase.config.neighbour
        self.headers = self.tenant.headers
        self.background_ids: list[str] = []  # background responses created and not yet cancelled

    def abuses(self) -> list[Coroutine[Any, Any, None]]:
        config = self.phase.config
        workers = {"tokenize": config.storm_workers, "reattach": config.storm_workers}
        return [getattr(self, abuse.replace("-", "_"))() for abuse in config.abuses or ABUSES
                for _ in range(workers.get(abuse, 1))]

    async def _loop(self, abuse: str, send: Callable[[], Awaitable[httpx.Response]]) -> None:
        while self.phase.is_open:
            try:
                response = await send()
                self.phase.note(abuse, response.status_code)
            except httpx.HTTPError as exc:
                self.phase.note(abuse, type(exc).__name__)
                await asyncio.sleep(0.1)

    async def large_batch(self) -> None:  # the abuses, named as in ABUSES
        rng = random.Random("neighbour/batch")
        items = [batch_request(self.tenant, rng, BATCH_API) for _ in range(self.phase.config.neighbour_batch_items)]
        records = [RequestRecord(self.tenant.tenant_id, BATCH_API, self.phase.now()) for _ in items]
        summaries: list[dict[str, Any]] = []
        try:
            await run_batch_job(self.http, self.phase.model, items, records, self.phase.now, summaries)
        finally:  # cancelled with the phase, most likely: still running (and then cancelled)
            for summary in summaries:
                created = summary["batch_id"] is not None and summary["status"] == "not_created"
                self.phase.note("large batch", "running at the end" if created else str(summary["status"]))

    async def poison_batch(self) -> None:
        """Lines that can never run: each must fail alone, at once."""
        lines = [json.dumps({"custom_id": f"poison-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": self.phase.model, "messages": [{"role": "user", "content": "x"}],
                                      "n": 10_000}}) for i in range(self.phase.config.poison_lines)]
        uploaded = await self.http.post("/v1/files", headers=self.headers, data={"purpose": "batch"},
                                        files={"file": ("poison.jsonl", "\n".join(lines).encode())})
        self.phase.note("poison batch", uploaded.status_code)
        if uploaded.status_code != 200:
            return
        created = await self.http.post("/v1/batches", headers=self.headers, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        self.phase.note("poison batch", created.status_code)

    async def uploads(self) -> None:
        content = b'{"x": "' + b"y" * (self.phase.config.upload_bytes - 10) + b'"}\n'

        async def upload_read_delete() -> httpx.Response:
            uploaded = await self.http.post("/v1/files", headers=self.headers, data={"purpose": "batch"},
                                            files={"file": ("big.jsonl", content)})
            if uploaded.status_code != 200:
                return uploaded
            file_id = uploaded.json()["id"]
            read = await self.http.get(f"/v1/files/{file_id}/content", headers=self.headers)
            self.phase.note("big uploads: read", read.status_code)
            return await self.http.delete(f"/v1/files/{file_id}", headers=self.headers)

        await self._loop("big uploads", upload_read_delete)

    async def tokenize(self) -> None:
        text = prompt_text(random.Random("neighbour/tokenize"), self.phase.config.tokenize_chars // 6)
        await self._loop("tokenize storm", lambda: self.http.post(
            "/tokenize", headers=self.headers, json={"model": self.phase.model, "prompt": text}))

    async def heavy_bodies(self) -> None:
        items = [{"role": "user", "content": f"item {i}"} for i in range(self.phase.config.heavy_items)]
        await self._loop("heavy Responses bodies", lambda: self.http.post(
            "/v1/responses", headers=self.headers, json={"model": self.phase.model, "input": items}))

    async def reattach(self) -> None:
        try:
            await self._reattach_storm()
        finally:  # a background response outlives the run, a restart too: it would run into the next one
            while self.background_ids:
                response_id = self.background_ids.pop()
                with contextlib.suppress(httpx.HTTPError, TimeoutError):
                    await asyncio.wait_for(self.http.post(f"/v1/responses/{response_id}/cancel",
                                                          headers=self.headers), timeout=5)

    async def _reattach_storm(self) -> None:
        response_id = await self._streamed_background_response()
        if response_id is None:
            return

        async def follow() -> httpx.Response:
            async with self.http.stream("GET", f"/v1/responses/{response_id}", headers=self.headers,
                                        params={"stream": "true"}) as response:
                await response.aread()
                return response

        await self._loop("re-attach storm", follow)

    async def _streamed_background_response(self) -> str | None:
        """A background response created with stream=true, left at its first event: its id."""
        body = {"model": self.phase.model, "input": "Tell me a long story.", "background": True, "stream": True,
                "max_output_tokens": 256}
        async with self.http.stream("POST", "/v1/responses", headers=self.headers, json=body) as created:
            self.phase.note("re-attach storm", created.status_code)
            if created.status_code != 200:
                await created.aread()
                return None
            async for line in created.aiter_lines():
                if line.startswith("data: "):
                    response_id = str(json.loads(line[len("data: "):])["response"]["id"])
                    self.background_ids.append(response_id)
                    return response_id
        return None

    async def pins(self) -> None:
        rng = random.Random("neighbour/pins")

        async def pin_a_prefix() -> httpx.Response:
            prefix = prompt_text(rng, self.phase.config.pin_words)
            return await self.http.post("/v1/messages", headers=self.headers, json={
                "model": self.phase.model, "max_tokens": 1, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": prefix, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]})

        await self._loop("pins", pin_a_prefix)


# ---- the report ---------------------------------------------------------------------------------


def build_noisy_report(result: NoisyResult) -> dict[str, Any]:
    phases = {phase.name: _phase_summary(phase) for phase in result.phases}
    ratios = {metric: _ratio(phases[NEIGHBOUR][metric], phases[ALONE][metric])
              for metric in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "batch_s")}
    num_5xx = sum(len(phase.server_errors) for phase in result.phases)
    within = all(ratio is not None and ratio <= result.config.max_ratio for ratio in ratios.values())
    return {"model": result.model, "light_tenant": result.config.light.tenant_id,
            "neighbour": result.config.neighbour.tenant_id, "phase_s": result.config.phase_s,
            "phases": phases, "ratios": ratios, "max_ratio": result.config.max_ratio,
            "server_errors": [error for phase in result.phases for error in phase.server_errors],
            "passed": within and num_5xx == 0}


def _phase_summary(phase: PhaseResult) -> dict[str, Any]:
    ok = [record for record in phase.chats if record.outcome == "ok"]
    ttfts = [record.ttft_s for record in ok if record.ttft_s is not None]
    itls = [later - earlier for record in ok for earlier, later in itertools.pairwise(record.chunk_times)]
    batch = phase.batch[0] if phase.batch else {}
    return {"chats": len(phase.chats), "chats_ok": len(ok),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "batch_s": batch.get("seconds") if batch.get("status") == "completed" else None,
            "batch_status": batch.get("status"),
            "abuses": {abuse: dict(outcomes) for abuse, outcomes in sorted(phase.abuses.items())}}


def _ratio(with_neighbour: float | None, alone: float | None) -> float | None:
    if with_neighbour is None or not alone:
        return None
    return round(with_neighbour / alone, 3)


def noisy_markdown(report: dict[str, Any]) -> str:
    alone, beside = report["phases"][ALONE], report["phases"][NEIGHBOUR]
    rows = [("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p99 (s)", "ttft_p99_s"), ("ITL p50 (s)", "itl_p50_s"),
            ("ITL p99 (s)", "itl_p99_s"), ("batch done (s)", "batch_s")]
    lines = [f"# noisy neighbour: {report['light_tenant']} beside {report['neighbour']} ({report['model']})", "",
             f"| {report['light_tenant']} | alone | with the neighbour | ratio |", "|---|---|---|---|"]
    lines += [f"| {label} | {_cell(alone[key])} | {_cell(beside[key])} | {_cell(report['ratios'][key])} |"
              for label, key in rows]
    lines += ["", f"chats ok: {alone['chats_ok']}/{alone['chats']} alone, {beside['chats_ok']}/{beside['chats']} "
                  "with the neighbour", "", "| the neighbour's abuse | answers |", "|---|---|"]
    lines += [f"| {abuse} | {', '.join(f'{status}: {count}' for status, count in sorted(outcomes.items()))} |"
              for abuse, outcomes in beside["abuses"].items()]
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines += ["", f"5xx answers: {len(report['server_errors'])}. {verdict} (every ratio within "
                  f"{report['max_ratio']}x, no 5xx)", ""]
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def write_noisy_report(report: dict[str, Any], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    summary = noisy_markdown(report)
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    return summary
