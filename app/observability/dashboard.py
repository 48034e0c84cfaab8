"""The live dashboard: a static page whose script reads a JSON snapshot per second over SSE.

Each connection keeps the previous snapshot's totals, so rates are per connection and nothing is
computed while nobody watches. A snapshot reads the scheduler on the event loop, like /metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.observability.metrics import (
    ServingMetrics,
    queued_by_tenant,
    requests_by_class,
    vtc_counters,
)
from app.plumbing.asgi import EventStreamResponse
from scheduling.snapshot import SchedulerSnapshot

PREEMPTION_MODES = ("swap", "recompute")
# Tells EventSource how long to wait before reconnecting after the server went away.
RECONNECT_MS = 2000


def _static(name: str) -> bytes:
    return resources.files("app.observability").joinpath("static", name).read_bytes()


@dataclass(slots=True, frozen=True)
class Totals:
    """The cumulative counts a snapshot's rates are taken against."""

    time: float
    generation_tokens: dict[str, int]
    prompt_tokens: dict[str, int]
    preemptions: dict[str, int]


class DashboardFeed:
    def __init__(self, scheduler_snapshot: Callable[[], SchedulerSnapshot], metrics: ServingMetrics, *,
                 interval_s: float = 1.0, is_draining: Callable[[], bool] = lambda: False) -> None:
        self._scheduler_snapshot = scheduler_snapshot
        self._metrics = metrics
        self.interval_s = interval_s
        self._is_draining = is_draining  # streams end when the server drains, so shutdown need not wait
        self._page = _static("dashboard.html")
        self._script = _static("dashboard.js")

    def totals(self, now: float) -> Totals:
        counts = self._metrics.counts
        preemptions = self._scheduler_snapshot().preemptions
        return Totals(now, dict(counts.generation_tokens), dict(counts.prompt_tokens),
                      {mode: preemptions.get(mode, 0) for mode in PREEMPTION_MODES})

    def snapshot(self, previous: Totals | None, now: float) -> tuple[dict[str, Any], Totals]:
        """The state now, with rates since `previous` (zero for the first snapshot)."""
        current = self.totals(now)
        base = previous or current
        elapsed = max(now - base.time, 1e-9)

        def rate(new: dict[str, int], old: dict[str, int], key: str) -> float:
            return round((new.get(key, 0) - old.get(key, 0)) / elapsed, 3)

        labels = self._metrics.labels
        scheduler = self._scheduler_snapshot()
        queued = queued_by_tenant(scheduler, labels)
        vtc = vtc_counters(scheduler, labels)
        tenants = [{
            "tenant": tenant,
            "generation_tokens_per_s": rate(current.generation_tokens, base.generation_tokens, tenant),
            "prompt_tokens_per_s": rate(current.prompt_tokens, base.prompt_tokens, tenant),
            "queued": {c: queued[c].get(tenant, 0) for c in queued},
            "vtc": {c: round(vtc[c].get(tenant, 0.0), 3) for c in vtc},
        } for tenant in labels.present(self._metrics.counts.generation_tokens, self._metrics.counts.prompt_tokens)]
        snapshot = {
            "time": time.time(),
            "interval_s": round(now - base.time, 3),
            "tenants": tenants,
            "classes": requests_by_class(scheduler),
            "kv_cache_usage": round(scheduler.kv_blocks.fraction, 4),
            "cpu_swap_usage": round(scheduler.cpu_blocks.fraction, 4),
            "preemptions": {mode: {"total": current.preemptions[mode],
                                   "new": current.preemptions[mode] - base.preemptions[mode]}
                            for mode in PREEMPTION_MODES},
        }
        return snapshot, current

    async def events(self) -> AsyncGenerator[bytes, None]:
        """A snapshot at once, then one per interval until the server drains."""
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        previous: Totals | None = None
        while not self._is_draining():
            snapshot, previous = self.snapshot(previous, time.monotonic())
            yield b"data: " + orjson.dumps(snapshot) + b"\n\n"
            await asyncio.sleep(self.interval_s)

    def routes(self) -> list[Route]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/dashboard.js", self.script, methods=["GET"]),
            Route("/dashboard/events", self.stream, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8")

    async def script(self, request: Request) -> Response:
        return Response(self._script, media_type="text/javascript; charset=utf-8")

    async def stream(self, request: Request) -> Response:
        return EventStreamResponse(self.events())
