"""OpenTelemetry traces: one span tree per request, exported over OTLP when the operator asks.

Imported only when `otlp_traces_endpoint` is set (app.observability.routes.trace_requests), so a server
without it never loads opentelemetry. The tree is built when the request finishes, from the times
it already carries, with explicit start and end times: while a request runs, the tracer only notes
when its tokens came and whether it was preempted since the last one.

    request                       arrival .. finish; tenant, class, model, token counts; event "finished"
    ├── queued                    arrival .. first scheduled
    ├── prefill                   first scheduled .. first token
    ├── decode                    first token .. finish
    ├── kv_handoff                disaggregated: the first token .. its blocks published and received
    └── preempted (one per gap)   the last token before a preemption .. the first token after it

The scheduler does not publish when it preempts a request, only how often (`num_preemptions`), so a
`preempted` span covers the whole gap in which it was preempted, resumed and caught up again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import Attributes

from scheduling.request import Request, TokenEvent

SERVICE_NAME = "fairlane"


@dataclass(slots=True)
class _Progress:
    """What the tracer remembers of a running request between its events."""

    last_token_time: float | None = None
    num_preemptions_seen: int = 0
    preempted: list[tuple[float, float, int]] = field(default_factory=list)  # (from, to, preemptions)


class RequestTracer:
    """An EngineObserver that turns each finished request into a span tree."""

    def __init__(self, provider: TracerProvider, model_name: str) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("fairlane.requests")
        self._model_name = model_name
        self._progress: dict[str, _Progress] = {}
        # Requests carry monotonic times; spans want nanoseconds since the epoch.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def exporting_to(cls, exporter: SpanExporter, model_name: str, *, batched: bool = True) -> RequestTracer:
        """A tracer on a provider of its own (never the process-wide one, so apps do not share it).
        Batched: spans leave from a background thread, never from the engine's task."""
        provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter))
        return cls(provider, model_name)

    @classmethod
    def over_otlp(cls, endpoint: str, model_name: str) -> RequestTracer:
        return cls.exporting_to(OTLPSpanExporter(endpoint=endpoint), model_name)

    def shutdown(self) -> None:
        """Export what is left and stop; blocking, so call it off the event loop."""
        self._provider.shutdown()

    # ---- EngineObserver ---------------------------------------------------------------------

    def on_tokens(self, request: Request, event: TokenEvent, now: float) -> None:
        progress = self._progress.setdefault(request.request_id, _Progress())
        self._note_preemptions(request, progress, now)
        progress.last_token_time = now

    def on_finished(self, request: Request, event: TokenEvent, now: float) -> None:
        progress = self._progress.pop(request.request_id, None) or _Progress()
        self._note_preemptions(request, progress, now)
        self._emit(request, event, progress, now)

    @staticmethod
    def _note_preemptions(request: Request, progress: _Progress, now: float) -> None:
        num_new = request.num_preemptions - progress.num_preemptions_seen
        if num_new <= 0:
            return
        since = progress.last_token_time or request.first_scheduled_time or request.arrival_time
        progress.preempted.append((since, now, num_new))
        progress.num_preemptions_seen = request.num_preemptions

    # ---- the span tree ----------------------------------------------------------------------

    def _emit(self, request: Request, event: TokenEvent, progress: _Progress, end: float) -> None:
        who = {"fairlane.tenant": request.tenant_id, "fairlane.class": request.priority.value,
               "fairlane.request_id": request.request_id}
        root = self._tracer.start_span("request", start_time=self._ns(request.arrival_time),
                                       attributes={**who, **self._usage(request, event)})
        parent = trace.set_span_in_context(root)
        scheduled, first_token = request.first_scheduled_time, request.first_token_time
        self._child("queued", parent, request.arrival_time, scheduled or end, who)
        if scheduled is not None:
            self._child("prefill", parent, scheduled, first_token or end, who)
        if first_token is not None:
            self._child("decode", parent, first_token, end, who)
        if first_token is not None and request.kv_handoff_s is not None:  # after the first token, before decode
            publish_s, fetch_s = request.kv_handoff_s
            self._child("kv_handoff", parent, first_token, first_token + publish_s + fetch_s,
                        {**who, "fairlane.kv_handoff.publish_s": publish_s, "fairlane.kv_handoff.fetch_s": fetch_s})
        for since, until, count in progress.preempted:
            self._child("preempted", parent, since, until, {**who, "fairlane.preemptions": count})
        root.add_event("finished", {"gen_ai.response.finish_reason": event.finish_reason or ""},
                       timestamp=self._ns(end))
        if event.finish_reason == "error":
            root.set_status(Status(StatusCode.ERROR, event.error))
        root.end(end_time=self._ns(end))

    def _usage(self, request: Request, event: TokenEvent) -> dict[str, str | int | tuple[str, ...]]:
        return {
            "fairlane.preemptions": request.num_preemptions,
            "gen_ai.request.model": self._model_name if request.adapter is None else request.adapter.name,
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.usage.input_tokens": event.num_prompt_tokens,
            "gen_ai.usage.output_tokens": event.num_output_tokens,
            "gen_ai.usage.cached_tokens": event.num_cached_tokens,
            "gen_ai.response.finish_reasons": (event.finish_reason or "",),
        }

    def _child(self, name: str, parent: Context, start: float, end: float, attributes: Attributes) -> Span:
        span = self._tracer.start_span(name, context=parent, start_time=self._ns(start), attributes=attributes)
        span.end(end_time=self._ns(max(start, end)))
        return span

    def _ns(self, monotonic_seconds: float) -> int:
        return int(monotonic_seconds * 1e9) + self._epoch_offset_ns
