"""Request traces: one span tree per request with its tenant and class, an OTLP export from a real
server when `otlp_traces_endpoint` is set, and no opentelemetry at all when it is not."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.observability.tracing import RequestTracer
from benchmarks.fake_executors import FakeExecutor
from scheduling.engine import Engine
from scheduling.request import PriorityClass, Request
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.app.conftest import ServerThread, instant_context, wait_for
from tests.app.test_metrics import TWO_TENANTS
from tests.factories import collect, make_geometry, make_request, running

INTERACTIVE, BATCH = PriorityClass.INTERACTIVE, PriorityClass.BATCH
PHASES = ("queued", "prefill", "decode")


def traced_engine(num_device_blocks: int = 64, num_cpu_blocks: int = 0) -> tuple[Engine, InMemorySpanExporter]:
    executor = FakeExecutor(make_geometry(num_device_blocks=num_device_blocks, num_cpu_blocks=num_cpu_blocks,
                                          block_size=4))
    engine = Engine(Scheduler(SchedulerConfig(), executor.geometry, TWO_TENANTS), executor)
    exporter = InMemorySpanExporter()
    engine.observers.append(RequestTracer.exporting_to(exporter, "tiny-model", batched=False))
    return engine, exporter


def timed(prompt: int, max_tokens: int, tenant: str, priority: PriorityClass) -> Request:
    return make_request(prompt, max_tokens, tenant_id=tenant, priority=priority, arrival_time=time.monotonic())


def trees(spans: Sequence[ReadableSpan]) -> dict[str, tuple[ReadableSpan, list[ReadableSpan]]]:
    """Each request's root span and its children, by request id; every span belongs to one tree."""
    roots = {span.context.span_id: span for span in spans if span.parent is None}
    found: dict[str, tuple[ReadableSpan, list[ReadableSpan]]] = {
        str((root.attributes or {})["fairlane.request_id"]): (root, []) for root in roots.values()}
    for span in spans:
        if span.parent is not None:
            root = roots[span.parent.span_id]
            assert span.context.trace_id == root.context.trace_id
            found[str((root.attributes or {})["fairlane.request_id"])][1].append(span)
    return found


def times(span: ReadableSpan) -> tuple[int, int]:
    assert span.start_time is not None and span.end_time is not None
    return span.start_time, span.end_time


def check_tree(request: Request, root: ReadableSpan, children: list[ReadableSpan], finish_reason: str) -> None:
    attributes = dict(root.attributes or {})
    assert root.name == "request"
    assert attributes["fairlane.tenant"] == request.tenant_id
    assert attributes["fairlane.class"] == request.priority.value
    assert attributes["gen_ai.request.model"] == "tiny-model"
    assert attributes["gen_ai.usage.input_tokens"] == request.num_prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == request.num_output_tokens
    assert attributes["fairlane.preemptions"] == request.num_preemptions
    assert [(event.name, dict(event.attributes or {})) for event in root.events] == [
        ("finished", {"gen_ai.response.finish_reason": finish_reason})]
    start, end = times(root)
    for child in children:
        assert start <= times(child)[0] <= times(child)[1] <= end, child.name
        assert (child.attributes or {})["fairlane.tenant"] == request.tenant_id
        assert (child.attributes or {})["fairlane.class"] == request.priority.value
    preempted = [(child.attributes or {})["fairlane.preemptions"] for child in children if child.name == "preempted"]
    assert all(isinstance(count, int) and count > 0 for count in preempted)
    assert sum(count for count in preempted if isinstance(count, int)) == request.num_preemptions


async def test_one_span_tree_per_request_with_its_phases_and_preemptions() -> None:
    """Two batch requests fill the device pool; interactive ones arriving after their first tokens
    preempt them (swapped to the CPU pool), and each tree shows the gap."""
    engine, exporter = traced_engine(num_device_blocks=8, num_cpu_blocks=16)
    batch = [timed(16, 12, "alice", BATCH), timed(12, 12, "bob", BATCH)]
    interactive = [timed(12, 3, "alice", INTERACTIVE), timed(8, 2, "bob", INTERACTIVE)]
    async with running(engine):
        batch_streams = [engine.submit(request) for request in batch]
        first_events = [aiter(stream) for stream in batch_streams]
        await asyncio.wait_for(anext(first_events[0]), timeout=30)
        interactive_streams = [engine.submit(request) for request in interactive]
        for stream in [*batch_streams, *interactive_streams]:
            await collect(stream)

    found = trees(exporter.get_finished_spans())
    requests = [*batch, *interactive]
    assert set(found) == {request.request_id for request in requests}
    assert sum(request.num_preemptions for request in batch) > 0
    for request in requests:
        root, children = found[request.request_id]
        check_tree(request, root, children, "length")
        phases = sorted((child for child in children if child.name in PHASES), key=lambda span: times(span)[0])
        assert [span.name for span in phases] == list(PHASES)
        queued, prefill, decode = (times(span) for span in phases)
        assert queued[1] == prefill[0] and prefill[1] == decode[0] and decode[1] == times(root)[1]
        assert queued[0] == times(root)[0]


async def test_an_aborted_request_is_a_tree_of_its_queue_time() -> None:
    engine, exporter = traced_engine()
    request = timed(6, 3, "bob", INTERACTIVE)
    async with running(engine):
        stream = engine.submit(request)
        stream.close()
        await collect(stream)

    root, children = trees(exporter.get_finished_spans())[request.request_id]
    check_tree(request, root, children, "abort")
    assert [child.name for child in children] == ["queued"]


# ---- a real server ------------------------------------------------------------------------------


class OTLPReceiver:
    """An OTLP/HTTP traces endpoint on loopback that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, dict[str, str]]] = []  # (name, string attributes)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.keep(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def keep(self, export: ExportTraceServiceRequest) -> None:
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((span.name, {a.key: a.value.string_value for a in span.attributes}))

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as started:
        yield started


def test_a_server_with_an_otlp_endpoint_exports_each_request(receiver: OTLPReceiver) -> None:
    server = ServerThread(instant_context(otlp_traces_endpoint=receiver.url)).start()
    try:
        for priority in ("auto", "flex"):  # interactive, then batch
            response = httpx.post(f"{server.base_url}/v1/completions", timeout=30, json={
                "model": server.model_name, "prompt": "hi", "max_tokens": 3, "service_tier": priority})
            assert response.status_code == 200, response.text
    finally:
        server.stop()  # flushes the spans still batched

    wait_for(lambda: sum(name == "request" for name, _ in receiver.spans) == 2, what="two request spans")
    roots = [attributes for name, attributes in receiver.spans if name == "request"]
    assert sorted(r["fairlane.class"] for r in roots) == ["batch", "interactive"]
    assert {r["fairlane.tenant"] for r in roots} == {"default"}
    assert sorted(name for name, _ in receiver.spans if name != "request") == sorted(PHASES * 2)


def test_without_an_endpoint_opentelemetry_is_never_imported(tmp_path: Path) -> None:
    """In a fresh interpreter (this one has imported it), an app built with the default settings.
    The instant executor keeps torch out too, so the check takes a second."""
    code = f"""
import sys
from app.serving.context import ServingContext
from app.process.server import create_app
from benchmarks.fake_executors import InstantExecutor, instant_geometry
from config.settings import load_settings
from gpu.tokenizer import ByteTokenizer
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler, SchedulerConfig

settings = load_settings(environ={{}}, overrides={{"model": "instant", "batch_db_path": {str(tmp_path / "b.db")!r}}})
geometry = instant_geometry(settings, max_model_len=1024)
create_app(ServingContext(settings, Engine(Scheduler(SchedulerConfig(), geometry), InstantExecutor(geometry)),
                          ByteTokenizer()))
loaded = [name for name in sys.modules if name.startswith("opentelemetry")]
assert not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
