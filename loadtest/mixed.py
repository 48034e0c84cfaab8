"""`python -m loadtest mixed`: the mixed-length trace of `fairlane bench queue-order`, against a real server.

Two tenants (the tenants file's first two; equal weights expected) send streamed interactive chats at
seeded Poisson times for `duration_s`: prompt and output lengths lognormal (medians about 300 and 100
tokens), and one request in twenty a 4,000-token document. The rate offers `load` times what a server
computing `tokens_per_s` prompt and output tokens a second serves, so past capacity the backlog grows until
the arrivals stop; then it drains. Every request is sent at its time, whatever the others do (open loop).

The capacity is the server's, measured before the trace unless given: a figure from one CPU offers another
CPU a different load (sized for 550 tokens a second, the trace offered an AVX2 EPYC, which serves about 120,
some six times its capacity, and its backlog then decided every figure). The measurement sends requests
of the trace's mean lengths, all at once and split between the tenants, and divides their tokens by the
time the last one took. A run `--against` an earlier report takes that report's capacity: two runs
compare only on the same trace.

The report: mean and p99 TTFT, the p99 TTFT of the longest prompt bucket (the documents), Jain's index
of the two tenants' service (prompt tokens at their first token, a token per content chunk) over the time
both had requests in flight, and the trace's tokens a second against what the server computed of it. Run
it once per server setting (say `--queue-order fcfs`, then `hrrn`, each on a freshly started server) and
give the first report to the second with `--against`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_output import format_table, write_run_report
from loadtest.client import OK, RequestRecord, send_chat, served_model
from loadtest.stats import jain_index, percentile
from loadtest.workload import INTERACTIVE, ChatRequest, LoadTenant, prompt_text

DOCUMENT_TOKENS = 4000
LONG_BUCKET = 2048  # prompts at least this long are the longest bucket
TOKENS_PER_WORD = 1.3  # of the filler text, with the default model's tokenizer (about)
CALIBRATION_REQUESTS = 8  # sent at once to measure the server's capacity: the trace's backlog batches too


@dataclass(slots=True, frozen=True)
class TraceRequest:
    arrival_s: float
    tenant: int  # index into the tenants
    prompt_tokens: int
    output_tokens: int


def draw_lengths(rng: random.Random) -> tuple[int, int]:
    """One request's prompt and output tokens: lognormal chats, one in twenty a document."""
    chat = min(2000, max(8, round(rng.lognormvariate(math.log(300), 0.8))))
    prompt = DOCUMENT_TOKENS if rng.random() < 0.05 else chat
    output = min(1000, max(4, round(rng.lognormvariate(math.log(100), 0.9))))
    return prompt, output


def poisson_trace(duration_s: float, seed: int, load: float, per_token_s: float, num_tenants: int = 2,
                  scale: float = 1.0) -> list[TraceRequest]:
    """Each tenant's Poisson arrivals, at a total rate offering `load` times a server's capacity when each
    token (prompt or output) costs it `per_token_s`; every length times `scale`."""
    rng = random.Random(seed)

    def scaled(lengths: tuple[int, int]) -> tuple[int, int]:
        return max(1, round(lengths[0] * scale)), max(1, round(lengths[1] * scale))

    drawn = [scaled(draw_lengths(rng)) for _ in range(2000)]
    rate = load / (per_token_s * sum(p + o for p, o in drawn) / len(drawn))
    requests: list[TraceRequest] = []
    for tenant in range(num_tenants):
        now = 0.0
        while True:
            now += rng.expovariate(rate / num_tenants)
            if now > duration_s:
                break
            requests.append(TraceRequest(now, tenant, *scaled(draw_lengths(rng))))
    return sorted(requests, key=lambda r: r.arrival_s)


@dataclass(slots=True, frozen=True)
class MixedConfig:
    url: str
    tenants: tuple[LoadTenant, ...]
    duration_s: float = 60.0
    load: float = 1.3
    tokens_per_s: float | None = None  # the server's capacity; None: measured before the trace
    seed: int = 0
    label: str = ""  # what the server ran with (its --queue-order, say): written into the report
    scale: float = 1.0  # every length times this (a quick check on a small model)
    request_timeout_s: float = 900.0

    def check(self) -> None:
        if len(self.tenants) < 2:
            raise ValueError("the mixed run needs a tenants file with two tenants")
        if self.duration_s <= 0 or self.load <= 0 or (self.tokens_per_s is not None and self.tokens_per_s <= 0):
            raise ValueError("duration, load and tokens per second must be positive")


@dataclass(slots=True)
class Sent:
    item: TraceRequest
    record: RequestRecord
    ended_at: float | None = None


@dataclass(slots=True)
class MixedResult:
    config: MixedConfig  # tokens_per_s set: given, or measured (then also in measured_tokens_per_s)
    sent: list[Sent] = field(default_factory=list)
    measured_tokens_per_s: float | None = None


async def run_mixed(config: MixedConfig) -> MixedResult:
    config.check()
    timeout, limits = httpx.Timeout(config.request_timeout_s), httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=limits) as http:
        model = await served_model(http, config.tenants[0])
        measured = None if config.tokens_per_s is not None else await measure_tokens_per_s(http, model, config)
        config = replace(config, tokens_per_s=config.tokens_per_s or measured)
        assert config.tokens_per_s is not None
        trace = poisson_trace(config.duration_s, config.seed, config.load, 1.0 / config.tokens_per_s,
                              scale=config.scale)
        result = MixedResult(config, measured_tokens_per_s=measured)
        start = time.monotonic()
        await asyncio.gather(*(_send(http, model, config, item, start, number, result)
                               for number, item in enumerate(trace)))
    return result


async def _send(http: httpx.AsyncClient, model: str, config: MixedConfig, item: TraceRequest, start: float,
                number: int, result: MixedResult) -> None:
    await asyncio.sleep(max(0.0, start + item.arrival_s - time.monotonic()))
    tenant = config.tenants[item.tenant]
    rng = random.Random(f"{config.seed}-{number}")
    text = f"Request {number}. {prompt_text(rng, round(item.prompt_tokens / TOKENS_PER_WORD))}"
    request = ChatRequest(tenant, INTERACTIVE, (("user", text),), item.output_tokens)
    sent = Sent(item, RequestRecord(tenant.tenant_id, INTERACTIVE, time.monotonic()))
    result.sent.append(sent)
    await send_chat(http, model, request, sent.record, time.monotonic)
    sent.ended_at = time.monotonic()


def mean_lengths(scale: float = 1.0, samples: int = 2000) -> tuple[int, int]:
    """The trace's mean prompt and output tokens (times `scale`), from a fixed draw."""
    rng = random.Random("mean lengths")
    drawn = [draw_lengths(rng) for _ in range(samples)]
    return (max(1, round(scale * sum(p for p, _ in drawn) / samples)),
            max(1, round(scale * sum(o for _, o in drawn) / samples)))


async def measure_tokens_per_s(http: httpx.AsyncClient, model: str, config: MixedConfig,
                               num_requests: int = CALIBRATION_REQUESTS) -> float:
    """The server's prompt and output tokens a second on requests of the trace's mean lengths, sent at once
    and split between the tenants (so that neither starts the trace ahead in service)."""
    prompt_tokens, output_tokens = mean_lengths(config.scale)
    records = [RequestRecord(config.tenants[i % 2].tenant_id, INTERACTIVE, time.monotonic())
               for i in range(num_requests)]
    requests = [ChatRequest(config.tenants[i % 2], INTERACTIVE, (("user", _calibration_text(i, prompt_tokens)),),
                            output_tokens) for i in range(num_requests)]
    start = time.monotonic()
    await asyncio.gather(*(send_chat(http, model, request, record, time.monotonic)
                           for request, record in zip(requests, records, strict=True)))
    seconds = time.monotonic() - start
    failed = [record.outcome for record in records if record.outcome != OK]
    if failed:
        raise RuntimeError(f"measuring the server's capacity failed: {failed}")
    served = sum(record.prompt_tokens + record.completion_tokens for record in records)
    return served / seconds


def _calibration_text(number: int, prompt_tokens: int) -> str:
    """A prompt of about `prompt_tokens` sharing no block with the trace's prompts or the other calibration
    ones (each starts with its own words)."""
    rng = random.Random(f"calibration-{number}")
    return f"Calibration {number}. {prompt_text(rng, round(prompt_tokens / TOKENS_PER_WORD))}"


# ---- the report ---------------------------------------------------------------------------------


def build_mixed_report(result: MixedResult, load_average: tuple[float, float],
                       against: dict[str, Any] | None = None) -> dict[str, Any]:
    done = [s for s in result.sent if s.record.outcome == OK and s.record.ttft_s is not None]
    ttfts = [s.record.ttft_s for s in done if s.record.ttft_s is not None]
    long_bucket = LONG_BUCKET * result.config.scale
    longest = [s.record.ttft_s for s in done if s.item.prompt_tokens >= long_bucket and s.record.ttft_s is not None]
    summary = {
        "requests": len(result.sent), "ok": len(done), "errors": len(result.sent) - len(done),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "longest_bucket_requests": len(longest), "longest_bucket_ttft_p99_s": percentile(longest, 99),
        "jain": jain_index(_service_while_both_backlogged(result)),
        **_offered_and_served(result),
    }
    report: dict[str, Any] = {
        "config": {k: v for k, v in asdict(result.config).items() if k != "tenants"},
        "load_average": list(load_average), "measured_tokens_per_s": result.measured_tokens_per_s,
        "summary": summary, "requests": request_rows(result)}
    if against is not None:
        theirs = against["summary"]
        report["against"] = {"label": against["config"].get("label", ""), "ratios": {
            key: summary[key] / theirs[key] if summary[key] and theirs.get(key) else None
            for key in ("ttft_mean_s", "ttft_p99_s", "longest_bucket_ttft_p99_s")},
            "jain_difference": None if summary["jain"] is None or theirs.get("jain") is None
            else summary["jain"] - theirs["jain"]}
    return report


def _offered_and_served(result: MixedResult) -> dict[str, float | None]:
    """The trace's tokens a second while it arrived, and those of its requests that were served, from the first
    request sent to the last one's end: past capacity the run is as far past as their ratio, whatever the
    capacity figure said (eight requests at once can batch far better than a trace of mixed lengths)."""
    offered = sum(s.item.prompt_tokens + s.item.output_tokens for s in result.sent) / result.config.duration_s
    ended = [s for s in result.sent if s.ended_at is not None and s.record.outcome == OK]
    if not ended:
        return {"offered_tokens_per_s": offered, "served_tokens_per_s": None, "offered_over_served": None}
    span_s = max(s.ended_at for s in ended if s.ended_at is not None) - min(s.record.sent_at for s in result.sent)
    served = sum(s.item.prompt_tokens + s.item.output_tokens for s in ended) / span_s  # the trace's lengths, as offered
    return {"offered_tokens_per_s": offered, "served_tokens_per_s": served,
            "offered_over_served": offered / served if served > 0 else None}


def request_rows(result: MixedResult) -> list[dict[str, Any]]:
    """Each request of the trace in arrival order: what was asked and what came back, so a run's mean can be
    traced to the requests that made it (one or two long waits decide it with 60 requests)."""
    return [{"arrival_s": round(s.item.arrival_s, 3), "tenant": s.item.tenant, "prompt_tokens": s.item.prompt_tokens,
             "output_tokens": s.item.output_tokens, "outcome": s.record.outcome,
             "ttft_s": None if s.record.ttft_s is None else round(s.record.ttft_s, 3),
             "e2e_s": None if s.ended_at is None else round(s.ended_at - s.record.sent_at, 3)}
            for s in sorted(result.sent, key=lambda sent: sent.item.arrival_s)]


def _service_while_both_backlogged(result: MixedResult) -> list[float]:
    """Per tenant: its prompt tokens (at their first token) and a token per content chunk, counted only
    while every tenant had a request in flight."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for s in result.sent:
        end = s.ended_at if s.ended_at is not None else s.record.sent_at
        spans.setdefault(s.item.tenant, []).append((s.record.sent_at, end))
    if len(spans) < 2:
        return []

    def all_backlogged(t: float) -> bool:
        return all(any(a <= t <= b for a, b in tenant_spans) for tenant_spans in spans.values())

    served = dict.fromkeys(spans, 0.0)
    for s in result.sent:
        record = s.record
        if record.ttft_s is not None and all_backlogged(record.sent_at + record.ttft_s):
            served[s.item.tenant] += s.item.prompt_tokens
        served[s.item.tenant] += sum(1 for t in record.chunk_times if all_backlogged(t))
    return list(served.values())


def mixed_table(report: dict[str, Any]) -> str:
    s = report["summary"]

    def sec(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    measured = " (measured)" if report.get("measured_tokens_per_s") else ""
    rows = [["capacity tok/s", f"{report['config']['tokens_per_s']:.0f}{measured}"],
            ["requests (ok)", f"{s['requests']} ({s['ok']})"], ["TTFT mean s", sec(s["ttft_mean_s"])],
            ["TTFT p50 s", sec(s["ttft_p50_s"])], ["TTFT p99 s", sec(s["ttft_p99_s"])],
            [f"longest bucket ({s['longest_bucket_requests']}) TTFT p99 s", sec(s["longest_bucket_ttft_p99_s"])],
            ["Jain (both backlogged)", "-" if s["jain"] is None else f"{s['jain']:.3f}"],
            ["offered / served tok/s", _offered_over_served(s)]]
    text = format_table([[report["config"]["label"] or "this run", ""], *rows]) + "\n"
    against = report.get("against")
    if against:
        ratios = "\n".join(f"  {key}: {value:.2f}x" for key, value in against["ratios"].items() if value)
        jain = against["jain_difference"]
        text += f"\nagainst {against['label'] or 'the given report'}:\n{ratios}\n"
        text += f"  Jain difference: {'-' if jain is None else f'{jain:+.3f}'}\n"
    return text


def _offered_over_served(summary: dict[str, Any]) -> str:
    if summary.get("offered_over_served") is None:
        return "-"
    return (f"{summary['offered_tokens_per_s']:.0f} / {summary['served_tokens_per_s']:.0f}"
            f" ({summary['offered_over_served']:.2f}x)")


def write_mixed_report(report: dict[str, Any], out_dir: Path) -> str:
    return write_run_report(report, out_dir, mixed_table(report))
