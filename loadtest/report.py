"""A load run's numbers: latency percentiles per tenant and class, throughput, errors by status,
Jain's index over tenants, the leak check; written as JSON and a Markdown summary.

Latencies count only what a user saw: TTFT for every request that got a first token (finished or
dropped on purpose), inter-token latency as the gaps between content chunks (a chunk can hold more
than one token when the server coalesces a lagging stream), end-to-end time for finished requests.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from loadtest.client import DROPPED, OK, RequestRecord
from loadtest.scenarios import RunResult
from loadtest.stats import jain_index, percentile
from loadtest.workload import BATCH_API

PERCENTILES = (50, 90, 99)
NUM_TIME_BUCKETS = 40
MIN_BUCKET_S = 0.5
SERVER_COUNTERS = ("requests_finished", "requests_aborted")


def latency(values: Sequence[float]) -> dict[str, float | int | None]:
    summary: dict[str, float | int | None] = {"n": len(values)}
    summary |= {f"p{p}": percentile(values, p) for p in PERCENTILES}
    return summary


def group_summary(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    served = [r for r in records if not r.is_error]
    finished = [r for r in records if r.outcome == OK]
    itl = [b - a for r in served if r.klass != BATCH_API for a, b in pairwise(r.chunk_times)]
    output_tokens = sum(r.completion_tokens for r in served)
    errors = Counter(r.outcome for r in records if r.is_error)
    return {
        "sent": len(records), "ok": len(finished), "dropped": sum(r.outcome == DROPPED for r in records),
        "num_errors": sum(errors.values()), "errors": dict(sorted(errors.items())),
        "ttft_s": latency([r.ttft_s for r in served if r.ttft_s is not None]),
        "itl_s": latency(itl),
        "e2e_s": latency([r.e2e_s for r in finished if r.e2e_s is not None]),
        "output_tokens": output_tokens,
        "requests_per_s": len(finished) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in served),
        "cached_tokens": sum(r.cached_tokens for r in served),
    }


def _by(records: Iterable[RequestRecord], key: str) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(getattr(record, key), []).append(record)
    return dict(sorted(groups.items()))


def throughput_over_time(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Output tokens/s per tenant in equal time buckets; a request's tokens are spread evenly over its
    content chunks (usage gives the count, not which chunk held which)."""
    bucket_s = max(MIN_BUCKET_S, wall_s / NUM_TIME_BUCKETS)
    num_buckets = int(wall_s / bucket_s) + 1
    series: dict[str, list[float]] = {}
    for record in records:
        buckets = series.setdefault(record.tenant, [0.0] * num_buckets)
        if record.is_error or not record.chunk_times:
            continue
        per_chunk = record.completion_tokens / len(record.chunk_times)
        for at in record.chunk_times:
            buckets[min(int(at / bucket_s), num_buckets - 1)] += per_chunk / bucket_s
    return {"bucket_s": bucket_s, "tenants": dict(sorted(series.items()))}


def _server_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    if not after:
        return {}
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in SERVER_COUNTERS}
    for group, key in (("preemptions", "swap"), ("preemptions", "recompute"), ("prefix_cache", "hit_tokens")):
        delta[f"{group}_{key}"] = after.get(group, {}).get(key, 0) - before.get(group, {}).get(key, 0)
    return delta


def build_report(result: RunResult) -> dict[str, Any]:
    config, records, wall_s = result.config, result.records, result.wall_s
    by_tenant = {tenant: group_summary(group, wall_s) for tenant, group in _by(records, "tenant").items()}
    weights = {t.tenant_id: t.weight for t in config.tenants}
    fair_shares = [summary["output_tokens_per_s"] / weights.get(tenant, 1.0) for tenant, summary in by_tenant.items()]
    totals = group_summary(records, wall_s)
    failures = list(result.settle.problems)
    return {
        "scenario": config.scenario, "passed": not failures, "failures": failures,
        "config": {"url": config.url, "duration_s": config.duration_s, "rate": config.rate,
                   "max_requests": config.max_requests, "seed": config.seed, "backlog": config.backlog,
                   "batch_items": config.batch_items, "tenants": {t.tenant_id: t.weight for t in config.tenants}},
        "model": result.model, "wall_s": wall_s,
        "totals": totals,
        "by_class": {klass: group_summary(group, wall_s) for klass, group in _by(records, "klass").items()},
        "by_tenant": by_tenant,
        "by_tenant_class": [{"tenant": tenant, "class": klass, **group_summary(group, wall_s)}
                            for tenant, tenant_records in _by(records, "tenant").items()
                            for klass, group in _by(tenant_records, "klass").items()],
        "jain_index": jain_index(fair_shares),
        "cached_share": totals["cached_tokens"] / totals["prompt_tokens"] if totals["prompt_tokens"] else None,
        "leak_check": result.settle.to_json(),
        "server_delta": _server_delta(result.stats_before, result.stats_after),
        "batches": result.batches,
        "throughput_over_time": throughput_over_time(records, wall_s),
        "requests": [{"tenant": r.tenant, "class": r.klass, "sent_at": round(r.sent_at, 4), "outcome": r.outcome,
                      "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "num_chunks": len(r.chunk_times),
                      "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                      "cached_tokens": r.cached_tokens} for r in records],
    }


def _ms(summary: dict[str, Any]) -> str:
    values = [summary[f"p{p}"] for p in PERCENTILES]
    return "/".join("-" if v is None else f"{v * 1000:.0f}" for v in values)


def _seconds(summary: dict[str, Any]) -> str:
    values = [summary[f"p{p}"] for p in PERCENTILES]
    return "/".join("-" if v is None else f"{v:.2f}" for v in values)


def _row(name: str, summary: dict[str, Any]) -> str:
    cells = [name, str(summary["sent"]), str(summary["ok"]), str(summary["dropped"]), str(summary["num_errors"]),
             f"{summary['requests_per_s']:.2f}", f"{summary['output_tokens_per_s']:.1f}", _ms(summary["ttft_s"]),
             _ms(summary["itl_s"]), _seconds(summary["e2e_s"])]
    return "| " + " | ".join(cells) + " |"


def markdown_summary(report: dict[str, Any], plots: Sequence[str] = ()) -> str:
    config = report["config"]
    tenants = ", ".join(f"{t} (weight {w:g})" for t, w in config["tenants"].items())
    check = report["leak_check"]
    verdict = (f"**Leak check: passed** (idle with every KV block free after {check['waited_s']:.1f} s)"
               if report["passed"] else "**Leak check: FAILED**: " + "; ".join(report["failures"]))
    lines = [f"# Load test: {report['scenario']}", "",
             f"Server {config['url']}, model `{report['model']}`; {config['duration_s']:g} s at "
             f"{config['rate']:g} interactive requests/s, seed {config['seed']}; tenants: {tenants}. "
             f"Last response ended at {report['wall_s']:.1f} s.", "", verdict, "",
             "| group | sent | ok | dropped | errors | req/s | out tok/s | TTFT p50/p90/p99 ms "
             "| ITL p50/p90/p99 ms | E2E p50/p90/p99 s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             _row("all", report["totals"])]
    lines += [_row(f"class {klass}", summary) for klass, summary in report["by_class"].items()]
    lines += [_row(f"{group['tenant']} / {group['class']}", group) for group in report["by_tenant_class"]]
    lines += ["", *(f"- {note}" for note in _notes(report))]
    lines += ["", *(f"![{Path(plot).stem}]({Path(plot).name})" for plot in plots)]
    return "\n".join(lines).rstrip() + "\n"


def _notes(report: dict[str, Any]) -> list[str]:
    totals, errors = report["totals"], report["totals"]["errors"]
    notes = ["Errors by status: " + (", ".join(f"{k}: {n}" for k, n in errors.items()) if errors else "none")]
    if report["jain_index"] is not None:
        notes.append(f"Jain's index over tenants (output tokens/s / weight): {report['jain_index']:.3f}")
    if totals["cached_tokens"] or report["scenario"] == "shared-prefix":
        notes.append(f"Prefix cache: {totals['cached_tokens']} of {totals['prompt_tokens']} prompt tokens cached "
                     f"({report['cached_share'] or 0:.0%})")
    if report["server_delta"]:
        notes.append("Server counters during the run: "
                     + ", ".join(f"{k} +{v}" for k, v in report["server_delta"].items()))
    notes += [f"Batch {b['batch_id']} ({b['tenant']}): {b['status']}, {b['items']} items, {b.get('seconds', '-')} s"
              for b in report["batches"]]
    return notes


def write_report(report: dict[str, Any], out_dir: Path, plots: Sequence[str] = ()) -> str:
    """Write report.json and summary.md into out_dir; returns the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    summary = markdown_summary(report, plots)
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    return summary
