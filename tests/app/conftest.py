"""Real servers for the HTTP tests: uvicorn on a loopback port, in a background thread.

Each can also be reached in-process (`in_process_client`), as the API and fuzz tests do.

Two kinds: the `builtin:tiny` model with a small KV budget (what the openai client, disconnect and
overload tests talk to), and the instant executor with a byte tokenizer, whose output is a known
script (framing, stop strings, UTF-8, validation fuzzing) at no model cost.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from starlette.types import ASGIApp

from app.process.engine_factory import build_runner, scheduler_config_of, tenants_of
from app.process.server import DrainingServer, uvicorn_config
from app.serving.context import ServingContext
from benchmarks.fake_executors import InstantExecutor, instant_geometry
from config.settings import Settings, load_settings
from contract.plan import CacheGeometry, StepPlan, StepResult
from gpu.models import LoadedModel
from gpu.tokenizer import ByteTokenizer, Tokenizer
from scheduling.engine import Engine, RequestStream
from scheduling.executor import Executor
from scheduling.request import Request
from scheduling.scheduler import Scheduler

MiB = 1024 * 1024
TINY = "builtin:tiny"
INSTANT = "instant"
# Small on purpose: 64 blocks of 16 tokens for builtin:tiny, so KV accounting is easy to watch.
# A float32 KV pool: the tests compare served tokens and log probabilities with transformers' float32
# forward, and the CPU's default pool is bfloat16 (gpu/kv_cache.resolve_kv_cache_dtype).
TINY_SETTINGS: dict[str, Any] = {"model": TINY, "device": "cpu", "kv_cache_bytes": 4 * MiB,
                                 "swap_space_bytes": 1 * MiB, "shutdown_grace_s": 2.0, "port": 0,
                                 "compile_mode": "eager", "kv_cache_dtype": "float32"}
INSTANT_SETTINGS: dict[str, Any] = {"model": INSTANT, "kv_cache_bytes": 1 * MiB, "block_size": 16,
                                    "max_body_bytes": 64 * 1024, "shutdown_grace_s": 2.0, "port": 0}


def wait_for(predicate: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.01,
             what: str = "the condition") -> None:
    """Poll until predicate holds; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class RecordingEngine(Engine):
    """An engine that keeps every request it was given, so tests can see what the API built."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *, max_queued_requests: int = 1024,
                 batch_queue_fraction: float = 0.75, stall_after_s: float = 60.0) -> None:
        super().__init__(scheduler, executor, max_queued_requests=max_queued_requests,
                         batch_queue_fraction=batch_queue_fraction, stall_after_s=stall_after_s)
        self.submitted: list[Request] = []

    def submit(self, request: Request) -> RequestStream:
        self.submitted.append(request)
        return super().submit(request)


class InProcessTransport(httpx.BaseTransport):
    """A blocking httpx transport over httpx's ASGITransport, run on the server's event loop. The body
    comes back whole (ASGITransport reads it to its end), and the client's read timeout bounds the wait."""

    def __init__(self, app: ASGIApp, loop: asyncio.AbstractEventLoop) -> None:
        # An exception escaping the app is what uvicorn would turn into a 500: the test sees the 500.
        self._app = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=("127.0.0.1", 1))
        self._loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        whole = httpx.Request(request.method, request.url, headers=request.headers, content=request.read())
        timeout_s = request.extensions.get("timeout", {}).get("read")
        return asyncio.run_coroutine_threadsafe(self._send(whole), self._loop).result(timeout=timeout_s)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        response = await self._app.handle_async_request(request)
        body = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=body, request=request)


class ServerThread:
    """A DrainingServer on 127.0.0.1, an OS-chosen port, its own event loop in a thread."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.server = DrainingServer(uvicorn_config(context, access_log=False, log_level="warning"), context)
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.base_url = ""

    @property
    def engine(self) -> RecordingEngine:
        assert isinstance(self.context.engine, RecordingEngine)
        return self.context.engine

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def model_name(self) -> str:
        return self.context.model_name

    def start(self) -> ServerThread:
        self._thread.start()
        wait_for(lambda: self.server.started or not self._thread.is_alive(), timeout=30, what="uvicorn to start")
        assert self.server.started, "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.request_shutdown()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "uvicorn did not stop"

    def in_process_client(self, timeout: float = 30.0) -> httpx.Client:
        """A client that hands each request straight to this server's app, on its event loop: the same
        app, engine and lifespan as over the socket, without the socket and uvicorn's parsing. For the
        many requests of the API and fuzz tests, not for what needs a connection (disconnects, slow or
        chunked bodies, header timeouts, connection limits) or a response read before it ends."""
        assert self.server.loop is not None, "start the server first"
        app = cast(ASGIApp, self.server.config.app)  # what uvicorn serves: the app and its HTTP limits
        return httpx.Client(transport=InProcessTransport(app, self.server.loop),
                            base_url="http://127.0.0.1", timeout=timeout)

    def stats(self) -> dict[str, Any]:
        """The engine's /stats, read on the server's event loop (no admin key needed)."""
        async def read() -> dict[str, Any]:
            return self.context.engine.stats()

        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(read(), self.server.loop).result(timeout=10)


# The test servers' databases, all under one folder removed when the test process ends.
_DATABASES = tempfile.TemporaryDirectory(prefix="fairlane-test-dbs-")


def fresh_db_path() -> str:
    """Each test server keeps its batches to itself: a runner works on every batch in its database."""
    return str(Path(tempfile.mkdtemp(dir=_DATABASES.name)) / "batches.db")


def tiny_context(loaded: LoadedModel, **overrides: Any) -> ServingContext:
    overrides.setdefault("batch_db_path", fresh_db_path())
    settings = load_settings(environ={}, overrides={**TINY_SETTINGS, **overrides})
    runner = build_runner(settings, loaded)
    return _context(settings, runner, runner.loaded.tokenizer)


def instant_context(script: bytes | None = None, **overrides: Any) -> ServingContext:
    """An instant server; given a script, every output is that script and then EOS."""
    overrides.setdefault("batch_db_path", fresh_db_path())
    settings = load_settings(environ={}, overrides={**INSTANT_SETTINGS, **overrides})
    geometry = instant_geometry(settings, max_model_len=1024)
    executor = InstantExecutor(geometry) if script is None else InstantExecutor(geometry, script, ByteTokenizer.EOS)
    return _context(settings, executor, ByteTokenizer())


def _context(settings: Settings, executor: Executor, tokenizer: Tokenizer) -> ServingContext:
    scheduler = Scheduler(scheduler_config_of(settings), executor.geometry, tenants_of(settings))
    engine = RecordingEngine(scheduler, executor, max_queued_requests=settings.max_queued_requests,
                             batch_queue_fraction=settings.batch_queue_fraction,
                             stall_after_s=settings.engine_stall_s)
    return ServingContext(settings, engine, tokenizer)


@pytest.fixture(scope="session")
def tiny_server(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    """Shared by tests that only read their own responses (counters are cumulative)."""
    server = ServerThread(tiny_context(tiny_model)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def instant_server() -> Iterator[ServerThread]:
    server = ServerThread(instant_context()).start()
    yield server
    server.stop()


@pytest.fixture
def start_tiny_server(tiny_model: LoadedModel) -> Iterator[Callable[..., ServerThread]]:
    """A fresh builtin:tiny server per call, settings overridden as given; all stopped at the end."""
    started: list[ServerThread] = []

    def start(**overrides: Any) -> ServerThread:
        server = ServerThread(tiny_context(tiny_model, **overrides)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class SteppedExecutor(InstantExecutor):
    """The instant executor, running a step only once the test allows it: work lasts exactly as long
    as the test holds it, whatever the machine's speed. A step held 60 s fails loudly."""

    def __init__(self, geometry: CacheGeometry) -> None:
        super().__init__(geometry)
        self._changed = threading.Condition()
        self._num_allowed = 0
        self._is_open = False

    @property
    def num_allowed(self) -> int:
        """Steps allowed that have not started yet."""
        return self._num_allowed

    def allow(self, num_steps: int) -> None:
        with self._changed:
            self._num_allowed += num_steps
            self._changed.notify_all()

    def open(self) -> None:
        """Run every step from now on, without holding (so that a server can finish and stop)."""
        with self._changed:
            self._is_open = True
            self._changed.notify_all()

    def step_until(self, done: Callable[[], bool], what: str) -> None:
        """Run steps one at a time until done() holds, so that the work stops within a step of it."""
        def next_step_or_done() -> bool:
            if self.num_allowed == 0:
                self.allow(1)
            return done()

        wait_for(next_step_or_done, timeout=60, what=what)

    def execute(self, plan: StepPlan) -> StepResult:
        with self._changed:
            if not self._changed.wait_for(lambda: self._is_open or self._num_allowed > 0, timeout=60):
                raise TimeoutError("the test never let this step run")
            if not self._is_open:
                self._num_allowed -= 1
        return super().execute(plan)


def stepped_server(tenants_file: Path | None = None, **overrides: Any) -> tuple[ServerThread, SteppedExecutor]:
    """An instant server whose every step waits for the test; open the executor before stopping it."""
    settings = load_settings(environ={}, overrides={**INSTANT_SETTINGS, "batch_db_path": fresh_db_path(),
                                                    "tenants_file": str(tenants_file) if tenants_file else None,
                                                    **overrides})
    executor = SteppedExecutor(instant_geometry(settings, max_model_len=1024))
    return ServerThread(_context(settings, executor, ByteTokenizer())).start(), executor
