"""The ingress deployment: the single server's Starlette app (routes, quotas, SSE, Batch API,
metrics) on a ClusterEngine, behind Ray Serve's HTTP proxy. The single server's HTTP limits apply:
the body timeout here, the head timeout and connection cap on the proxy (cluster.proxy_limits), the
drain's 503 with Retry-After through `drain`.

There is exactly one ingress replica: quotas (max_concurrent, tokens_per_minute) are counted once,
here, across every engine replica, and the Batch API's SQLite store keeps its one writer.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from starlette.types import ASGIApp

from app.plumbing.http_limits import BodyTimeoutMiddleware
from app.process.server import create_app, drain
from app.serving.context import ServingContext
from cluster.addresses import bind_replica_grpc_to_node_address
from cluster.remote_engine import ClusterEngine, RemoteExecutor
from cluster.wire import ReplicaDescription
from config.settings import Settings
from contract.plan import StructuredOutput

# A replica report older than this many sync intervals means the replica is gone (or stuck).
REPORT_MAX_AGE_INTERVALS = 30


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, settings: Settings, replicas: Any, board: Any,  # type: ignore[misc]  # Serve awaits it
                       prefill: Any = None) -> None:
        bind_replica_grpc_to_node_address()
        description: ReplicaDescription = await replicas.describe.remote()

        def check_structured(structured: StructuredOutput) -> None:  # run in a worker thread by the routes
            replicas.check_structured.remote(structured).result()

        engine = ClusterEngine(RemoteExecutor(description.geometry, check_structured), description.tenants,
                               replicas.options(stream=True, method_name="generate"), board,
                               max_queued_requests=settings.max_queued_requests,
                               batch_queue_fraction=settings.batch_queue_fraction,
                               stall_after_s=settings.engine_stall_s,
                               report_max_age_s=max(2.0, REPORT_MAX_AGE_INTERVALS * settings.vtc_sync_interval_s),
                               prefill=None if prefill is None else prefill.options(stream=True, method_name="prefill"),
                               min_handoff_prompt_tokens=settings.disaggregation_min_prompt_tokens)
        self.context = ServingContext(settings, engine, description.tokenizer,
                                      replica_snapshots=engine.replica_snapshots)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        settings = self.context.settings
        return BodyTimeoutMiddleware(create_app(self.context), settings.http_body_timeout_s)

    async def drain(self) -> None:
        """The single server's drain on SIGTERM: new requests get 503 with Retry-After while running
        ones get the grace period, then the rest end with an error. The launcher calls it before
        Serve stops anything."""
        await drain(self.context)
