"""`fairlane serve`: the Starlette app on uvicorn, with a shutdown that drains before it stops.

On SIGTERM (or Ctrl-C) the server keeps listening but answers new generations with 503 and
/health with 503, gives running requests `settings.shutdown_grace_s` to finish, ends the rest
with an error event, and only then lets uvicorn close. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from app.anthropic.errors import AnthropicError, anthropic_error_handler
from app.anthropic.routes import MESSAGES_PATH, AnthropicRoutes
from app.batch.api import BatchAPI
from app.observability.routes import Observability, metrics_options, trace_requests
from app.openai.routes import OpenAIRoutes
from app.openai.tokenization import TokenizationRoutes
from app.plumbing.asgi import CLIENT_CLOSED_STATUS, ClientGone, RequestIdMiddleware, ShutdownAnswerMiddleware
from app.plumbing.errors import APIError, api_error_handler, http_exception_handler, unexpected_error_handler
from app.plumbing.http_limits import BodyTimeoutMiddleware, header_timeout_protocol, uvicorn_limit_concurrency
from app.plumbing.private_dirs import prepare_data_dirs
from app.plumbing.rejection_pacing import ErrorHandler, RejectionPacing
from app.process.flags import add_model_flags, settings_from_args
from app.responses.api import ResponsesAPI
from app.serving.context import ServingContext
from app.serving.submission import SHUTTING_DOWN, shutting_down
from config.settings import Settings
from scheduling.gc_pacing import paced_collection

logger = logging.getLogger(__name__)

SERVE_FLAG_KEYS = ("host", "port", "served_model_name", "shutdown_grace_s", "max_body_bytes",
                   "default_max_tokens", "max_queued_requests", "batch_queue_fraction", "tenants_file",
                   "metrics_names", "otlp_traces_endpoint", "stream_interval", "batch_stream_interval")
# After the drain every generation has ended; this only bounds clients too slow to read their last bytes.
CLOSE_TIMEOUT_S = 5


async def _client_gone_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


def create_app(context: ServingContext) -> ASGIApp:
    """The ASGI app. Its lifespan starts the engine and, at the very end, stops it."""

    openai = OpenAIRoutes(context)
    batches = BatchAPI.build(context.settings, context.gate, openai.run_batch_item, context.model_name)
    responses = ResponsesAPI.build(context)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await context.engine.start()
        batches.runner.start()
        await responses.start()
        context.start_compiling()
        try:
            yield
        finally:
            await responses.stop()
            await batches.stop()
            await context.engine.shutdown(SHUTTING_DOWN)
            context.off_loop.close()
            if tracer is not None:  # the last spans leave over the network: off the event loop
                await anyio.to_thread.run_sync(tracer.shutdown)

    settings = context.settings
    options = metrics_options(settings, context.model_name, context.geometry.max_model_len)
    observability = Observability.attach(context.engine, is_draining=lambda: context.is_draining, options=options,
                                         replica_snapshots=context.replica_snapshots)
    observability.guard = context.gate.authorize_operator
    observability.metrics_public = settings.metrics_public
    observability.count_batches = batches.store.count_batches
    tracer = trace_requests(context.engine, settings, context.model_name)
    tokenization = TokenizationRoutes(context)
    anthropic = AnthropicRoutes(context)
    routes = [*openai.routes(), *anthropic.routes(), *tokenization.routes(), *batches.routes, *responses.routes,
              *observability.routes()]
    pacing = refusal_pacing(settings)
    openai_errors = observability.count_rejections(pacing(api_error_handler))
    anthropic_errors = observability.count_rejections(pacing(anthropic_error_handler))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: openai_errors,
        AnthropicError: anthropic_errors,
        HTTPException: http_exception_handler,
        ClientGone: _client_gone_handler,
        Exception: unexpected_error_handler,
    })

    async def shutting_down_answer(request: Request) -> Response:
        if request.url.path.startswith(MESSAGES_PATH):
            return await anthropic_errors(request, AnthropicError.of(shutting_down()))
        return await openai_errors(request, shutting_down())

    return RequestIdMiddleware(ShutdownAnswerMiddleware(app, lambda: context.is_draining, shutting_down_answer))


def refusal_pacing(settings: Settings) -> Callable[[ErrorHandler], ErrorHandler]:
    """What wraps the API error handlers: each tenant's 429s paced past its free rate, or nothing."""
    if settings.tenant_refusals_per_s is None:
        return lambda handler: handler
    return RejectionPacing(settings.tenant_refusals_per_s, settings.refusal_pause_s).paced


async def drain(context: ServingContext) -> None:
    """Stop taking work, give running requests the grace period, then end the rest with an error."""
    context.is_draining = True
    context.engine.stop_accepting()
    grace_s = context.settings.shutdown_grace_s
    if not await context.engine.wait_idle(grace_s):
        logger.warning("ending %d requests still running after the %.1f s grace period",
                       context.engine.num_unfinished, grace_s)
        await context.engine.shutdown(SHUTTING_DOWN)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first exit signal drains the engine before the server stops."""

    def __init__(self, config: uvicorn.Config, context: ServingContext) -> None:
        super().__init__(config)
        self._context = context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._is_shutdown_requested = False
        self.exit_code = 0  # 1 once the engine has failed: a supervisor should restart the process
        context.engine.on_failure.append(self._on_engine_failure)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the server runs on, once it runs."""
        return self._loop

    def _on_engine_failure(self, reason: str) -> None:
        logger.error("the engine failed (%s): stopping with exit status 1", reason)
        self.exit_code = 1
        self.request_shutdown()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._is_shutdown_requested:
            super().handle_exit(sig, frame)  # a second signal: uvicorn's own, immediate exit
        else:
            self.request_shutdown()

    def request_shutdown(self) -> None:
        """Drain, then stop. Safe to call from a signal handler or another thread; idempotent."""
        if self._is_shutdown_requested:
            return
        self._is_shutdown_requested = True
        if self._loop is None or not self.started:
            self.should_exit = True  # nothing is running yet that could need a drain
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain_then_exit(), name="fairlane-drain")

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._context)
        finally:
            self.should_exit = True


def uvicorn_config(context: ServingContext, *, access_log: bool = True, log_level: str = "info") -> uvicorn.Config:
    """uvicorn for this app, with the HTTP limits of app.plumbing.http_limits: a deadline on each request head
    (our subclass of uvicorn's httptools protocol), on each wait for a body piece, and a cap on open
    connections (uvicorn's limit_concurrency: a request on one connection too many gets 503)."""
    settings = context.settings
    app = BodyTimeoutMiddleware(create_app(context), settings.http_body_timeout_s)
    return uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                          access_log=access_log, log_level=log_level, timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
                          http=header_timeout_protocol(settings.http_header_timeout_s),
                          limit_concurrency=uvicorn_limit_concurrency(settings.max_connections))


def add_serve_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    add_model_flags(parser)
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks a free one)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: the --model spec)")
    parser.add_argument("--shutdown-grace-s", type=float, help="seconds running requests get on SIGTERM")
    parser.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413")
    parser.add_argument("--default-max-tokens", type=int, help="max_tokens when a request gives none")
    parser.add_argument("--max-queued-requests", type=int,
                        help="requests the engine holds, running or waiting, before it refuses more (default 1024)")
    parser.add_argument("--batch-queue-fraction", type=float,
                        help="share of that queue batch-class requests may fill (default 0.75)")
    parser.add_argument("--stream-interval", type=int,
                        help="tokens an interactive stream sends at once after its first (default 1)")
    parser.add_argument("--batch-stream-interval", type=int,
                        help="the same for batch-class streams (service_tier flex; default 8, held at most 0.5 s)")
    parser.add_argument("--tenants", dest="tenants_file", help="a tenants TOML file: API keys, weights, limits")
    parser.add_argument("--metrics-names", choices=["fairlane", "vllm"],
                        help="vllm: serve every metric under the vllm: prefix too, for vLLM's dashboards")
    parser.add_argument("--otlp-traces-endpoint",
                        help="send a span tree per request over OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces")
    parser.set_defaults(handler=run_serve)


def warn_if_unauthenticated(settings: Settings) -> None:
    if settings.tenants_file is None:
        logger.warning("no tenants file: every caller is the tenant 'default', without authentication")


def run_serve(args: argparse.Namespace) -> int:
    from app.process.engine_factory import build_engine  # imports torch: only when actually serving

    settings = settings_from_args(args, SERVE_FLAG_KEYS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warn_if_unauthenticated(settings)
    prepare_data_dirs(settings)  # before the model and compile caches write into ./data
    engine, runner = build_engine(settings, compile_in_background=not settings.compile_wait)
    context = ServingContext(settings, engine, runner.loaded.tokenizer)
    server = DrainingServer(uvicorn_config(context), context)
    # What start-up made lives as long as the server: out of the garbage collector's full passes, which
    # otherwise stall a step for 100 ms and more; the engine makes the collections while the runner computes.
    with paced_collection():
        server.run()
    return server.exit_code
