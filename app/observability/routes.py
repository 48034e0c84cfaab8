"""What an operator sees of a running server: /metrics, /dashboard, traces, and the request log.

`Observability.attach(engine)` registers the metrics observer on the engine and gives the routes
to add to the app; `trace_requests` adds the OpenTelemetry observer when tracing is configured.
Requests the HTTP layer turns away are counted by wrapping its APIError handler
(`count_rejections`), or reported directly with `record_rejection`. The tenant of a rejection is
`request.state.tenant_id` when authentication set one, the default tenant on a server without
authentication, else "unknown".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.batch.database import StoreError
from app.observability.dashboard import DashboardFeed
from app.observability.metric_names import MetricsOptions
from app.observability.metrics import RejectionReason, ReplicaSnapshots, ServingMetrics, rejection_reason
from app.plumbing.errors import APIError
from config.settings import Settings
from scheduling.engine import EngineFront
from tenancy.tenants import DEFAULT_TENANT, TenantRegistry

if TYPE_CHECKING:
    from app.observability.tracing import RequestTracer

logger = logging.getLogger(__name__)

ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]
# Batches by (tenant id, status), counted by the Batch API's store off the event loop.
BatchCounter = Callable[[], Awaitable[Mapping[tuple[str, str], int]]]


Endpoint = Callable[[Request], Awaitable[Response]]


def guarded(endpoint: Callable[..., Any], guard: Callable[[Request], None]) -> Endpoint:
    """The endpoint, run only for callers the guard lets in."""

    async def checked(request: Request) -> Response:
        guard(request)
        response: Response = await endpoint(request)
        return response

    return checked


class Observability:
    def __init__(self, metrics: ServingMetrics, dashboard: DashboardFeed, tenants: TenantRegistry) -> None:
        self.metrics = metrics
        self.dashboard = dashboard
        self._tenants = tenants
        self.guard: Callable[[Request], None] = lambda request: None  # raises APIError for a caller not let in
        self.metrics_public = False  # /metrics without the guard
        self.count_batches: BatchCounter | None = None  # the Batch API's store, read at each scrape

    @classmethod
    def attach(cls, engine: EngineFront, *, tenants: TenantRegistry | None = None,
               is_draining: Callable[[], bool] = lambda: False, dashboard_interval_s: float = 1.0,
               options: MetricsOptions | None = None, replica_snapshots: ReplicaSnapshots | None = None
               ) -> Observability:
        """Metrics for this engine (tenant labels from `tenants`, by default the scheduler's), its
        observer appended to `engine.observers`. Without `options`, the model_name label is
        "default" and token-count buckets reach the engine's context length. With `replica_snapshots`
        (a cluster's ingress) the engine gauges and counters are the replicas', labelled by replica."""
        tenants = tenants if tenants is not None else engine.tenants
        options = options or MetricsOptions(max_model_len=engine.geometry.max_model_len)
        metrics = ServingMetrics(lambda: engine.snapshot, tenants, options, replica_snapshots)
        engine.observers.append(metrics.observer)
        dashboard = DashboardFeed(lambda: engine.snapshot, metrics, interval_s=dashboard_interval_s,
                                  is_draining=is_draining)
        return cls(metrics, dashboard, tenants)

    def routes(self) -> list[Route]:
        """Every route behind `guard` (/metrics too unless `metrics_public`): they show every tenant's
        ids, usage and queues."""
        metrics = self.prometheus if self.metrics_public else guarded(self.prometheus, self.guard)
        dashboard = [Route(r.path, guarded(r.endpoint, self.guard), methods=list(r.methods or ["GET"]))
                     for r in self.dashboard.routes()]
        return [Route("/metrics", metrics, methods=["GET"]), *dashboard]

    def record_rejection(self, reason: RejectionReason, tenant_id: str | None = None) -> None:
        self.metrics.record_rejection(reason, tenant_id)

    def count_rejections(self, handler: ErrorHandler) -> ErrorHandler:
        """The APIError handler, counting each answer that turns a request away."""

        async def counting_handler(request: Request, exc: Exception) -> Response:
            if isinstance(exc, APIError):
                reason = rejection_reason(exc.status, exc.code)
                if reason is not None:
                    self.record_rejection(reason, self._tenant_of(request))
            return await handler(request, exc)

        return counting_handler

    def _tenant_of(self, request: Request) -> str | None:
        tenant_id = getattr(request.state, "tenant_id", None)
        if isinstance(tenant_id, str):
            return tenant_id
        return None if self._tenants.requires_auth else DEFAULT_TENANT

    async def prometheus(self, request: Request) -> Response:
        # Reads the engine's snapshot of the last step: never the scheduler half-way through one.
        await self._refresh_batch_jobs()
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _refresh_batch_jobs(self) -> None:
        if self.count_batches is None:
            return
        try:
            self.metrics.set_batch_jobs(await self.count_batches())
        except StoreError:  # the other metrics still answer; batch_jobs keeps its last counts
            logger.exception("could not count batches for /metrics")


def metrics_options(settings: Settings, model_name: str, max_model_len: int) -> MetricsOptions:
    return MetricsOptions(model_name=model_name, max_model_len=max_model_len, names=settings.metrics_names)


def trace_requests(engine: EngineFront, settings: Settings, model_name: str) -> RequestTracer | None:
    """With `otlp_traces_endpoint` set, an OpenTelemetry observer on the engine (the caller shuts it
    down at exit to flush its spans); else None, and opentelemetry is never imported."""
    if settings.otlp_traces_endpoint is None:
        return None
    try:
        from app.observability.tracing import RequestTracer
    except ImportError as exc:
        raise RuntimeError("otlp_traces_endpoint needs opentelemetry: install fairlane's `tracing` extra"
                           ) from exc
    tracer = RequestTracer.over_otlp(settings.otlp_traces_endpoint, model_name)
    engine.observers.append(tracer)
    return tracer
