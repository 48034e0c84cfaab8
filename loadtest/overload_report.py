"""An overload run's report: goodput against capacity, refusals and their Retry-After, TTFT of the
admitted interactive requests, 5xx, recovery, the requests that failed otherwise; the verdicts; JSON,
Markdown and a plot over time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from loadtest.failed_requests import failed_requests, failed_requests_markdown
from loadtest.overload import CAPACITY, RECOVERY, REFUSED, SURGE, Attempt, OverloadResult, summary_of
from loadtest.workload import BATCH, INTERACTIVE

DPI = 80
PLOT = "overload_over_time.png"
BUCKET_S = 5.0
COLLAPSE_SHARE = 0.5  # interactive goodput in the surge below half the capacity is a collapse


def verdicts(report: dict[str, Any]) -> list[str]:
    """What failed; empty when the server held."""
    surge, capacity = report["phases"][SURGE], report["phases"][CAPACITY]
    found = []
    server_errors = {o: n for o, n in surge["outcomes"].items() if o.startswith("5") and o != "503"}
    if server_errors:
        found.append(f"5xx answers other than 503 in the surge: {server_errors}")
    missing = sum(p["refused_without_retry_after"] for p in report["phases"].values())
    if missing:
        found.append(f"{missing} refusal(s) without Retry-After")
    interactive = surge["by_class"].get(INTERACTIVE, {}).get("goodput_tokens_per_s", 0.0)
    if interactive < COLLAPSE_SHARE * capacity["goodput_tokens_per_s"]:
        found.append(f"interactive goodput collapsed: {interactive:.1f} tokens/s in the surge against "
                     f"{capacity['goodput_tokens_per_s']:.1f} at capacity")
    found += _batch_not_shed_first(surge["by_class"])
    if report["recovery_s"] is None:
        found.append("the server did not recover within the timeout")
    return found


def _batch_not_shed_first(by_class: dict[str, Any]) -> list[str]:
    """The failure when a larger share of interactive requests than of batch ones was refused in the
    surge (per request, not per attempt: see loadtest.overload._refusals)."""
    interactive, batch = by_class.get(INTERACTIVE), by_class.get(BATCH)
    if interactive is None or batch is None \
            or interactive["requests_refused_share"] <= batch["requests_refused_share"]:
        return []
    shares = f"{interactive['requests_refused_share']:.1%} against {batch['requests_refused_share']:.1%}"
    return [f"interactive requests were refused more often than batch ones ({shares} of their requests): "
            "batch was not shed first"]


def build_overload_report(result: OverloadResult) -> dict[str, Any]:
    config = result.config
    report: dict[str, Any] = {
        "scenario": "overload", "model": result.model,
        "config": {"url": config.url, "capacity_clients": config.capacity_clients, "factor": config.factor,
                   "surge_clients": config.capacity_clients * config.factor, "capacity_s": config.capacity_s,
                   "surge_s": config.surge_s, "batch_share": config.batch_share, "seed": config.seed,
                   "tenants": [t.tenant_id for t in config.tenants]},
        "phases": {phase: summary_of(result.attempts, phase, span) for phase, span in result.phase_spans.items()},
        "recovery_s": result.recovery_s,
        "over_time": over_time(result.attempts),
        # Refusals are what the run provokes, counted per phase above: listing them would bury the rest.
        "failed_requests": failed_requests([({"phase": a.phase, "class": a.record.klass}, a.record)
                                            for a in result.attempts
                                            if a.record.is_error and a.record.outcome not in REFUSED]),
    }
    capacity = report["phases"][CAPACITY]["goodput_tokens_per_s"]
    report["surge_goodput_vs_capacity"] = (report["phases"][SURGE]["goodput_tokens_per_s"] / capacity
                                           if capacity else None)
    report["failures"] = verdicts(report)
    report["passed"] = not report["failures"]
    return report


def over_time(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """Per bucket: completed tokens/s per class (at each request's end) and refusals/s."""
    end = max((a.record.ended_at for a in attempts), default=0.0)
    count = int(end / BUCKET_S) + 1
    series: dict[str, list[float]] = {f"goodput_{INTERACTIVE}": [0.0] * count, f"goodput_{BATCH}": [0.0] * count,
                                      "refused": [0.0] * count}
    for attempt in attempts:
        record = attempt.record
        bucket = min(int(record.ended_at / BUCKET_S), count - 1)
        if record.outcome == "ok" and f"goodput_{record.klass}" in series:
            series[f"goodput_{record.klass}"][bucket] += record.completion_tokens / BUCKET_S
        elif record.outcome in REFUSED:
            series["refused"][bucket] += 1 / BUCKET_S
    return {"bucket_s": BUCKET_S, "series": series}


def _ttft(summary: dict[str, Any]) -> str:
    return "/".join("-" if v is None else f"{v * 1000:.0f}" for v in summary["ttft_s"].values())


def _requests_refused(summary: dict[str, Any]) -> str:
    return f"{summary['requests_refused']} of {summary['requests']} ({summary['requests_refused_share']:.1%})"


def overload_markdown(report: dict[str, Any], plots: Sequence[str] = ()) -> str:
    config = report["config"]
    verdict = "**Overload: held**" if report["passed"] else "**Overload: FAILED**: " + "; ".join(report["failures"])
    ratio = report["surge_goodput_vs_capacity"]
    recovery = report["recovery_s"]
    lines = [f"# Overload: {config['surge_clients']} clients against a capacity of {config['capacity_clients']}", "",
             f"Server {config['url']}, model `{report['model']}`; {config['capacity_s']:g} s at capacity, then "
             f"{config['surge_s']:g} s of surge ({config['batch_share']:.0%} of its clients send batch-class work); "
             "every client honours Retry-After with exponential backoff.", "", verdict, "",
             "| phase / class | attempts | ok | refused | refused share | requests refused | refused w/o Retry-After "
             "| goodput tok/s | TTFT p50/p90/p99 ms | outcomes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for phase, summary in report["phases"].items():
        for name, group in [(phase, summary)] + [(f"{phase} / {k}", g) for k, g in summary["by_class"].items()]:
            lines.append(f"| {name} | {group['attempts']} | {group['ok']} | {group['refused']} | "
                         f"{group['refused_share']:.1%} | {_requests_refused(group)} | "
                         f"{group['refused_without_retry_after']} | {group['goodput_tokens_per_s']:.1f} | "
                         f"{_ttft(group)} | {', '.join(f'{o}: {n}' for o, n in group['outcomes'].items())} |")
    if not report["phases"][SURGE]["refused"]:
        lines += ["", "Nothing was refused in the surge: it never filled the server's queue, so whether batch "
                      "work is shed first was not tried (start the server with a `--max-queued-requests` below "
                      "the surge's clients)."]
    lines += ["", f"- Surge goodput against capacity: {'-' if ratio is None else f'{ratio:.2f}x'}",
              f"- Recovery after the surge: {'not within the timeout' if recovery is None else f'{recovery:.1f} s'} "
              "(until an interactive probe's TTFT is back within 2x the capacity phase's median)"]
    lines += ["", *failed_requests_markdown(report["failed_requests"], ("phase", "class"),
                                            "Requests that did not end ok, refusals (429, 503) aside")]
    lines += ["", *(f"![{Path(plot).stem}]({Path(plot).name})" for plot in plots)]
    return "\n".join(lines).rstrip() + "\n"


def overload_plot(report: dict[str, Any], path: Path) -> None:
    figure = Figure(figsize=(8, 3.4), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    bucket_s = report["over_time"]["bucket_s"]
    for name, values in report["over_time"]["series"].items():
        label = "refused requests/s" if name == "refused" else name.replace("goodput_", "completed tokens/s, ")
        ax.plot([(i + 0.5) * bucket_s for i in range(len(values))], values, label=label)
    for phase, color in ((SURGE, "tab:red"), (RECOVERY, "tab:green")):
        start, end = report["phases"][phase]["span"]
        ax.axvspan(start, end, color=color, alpha=0.08, label=phase)
    ax.set_xlabel("seconds since the start")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    figure.suptitle("overload: goodput and refusals over time")
    figure.savefig(path)


def write_overload_report(report: dict[str, Any], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = out_dir / PLOT
    overload_plot(report, plot)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    summary = overload_markdown(report, [str(plot)])
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    return summary
