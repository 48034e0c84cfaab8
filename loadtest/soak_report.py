"""A soak's report: for each resource its baseline, peak under load and idle value after, and whether
it came back; latency percentiles per window and the drift from the first window to the last; what
each kind of request got. JSON, Markdown and plots over time.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from loadtest.client import RequestRecord
from loadtest.failed_requests import failed_requests, failed_requests_markdown
from loadtest.probe import Sample
from loadtest.soak import BASELINE, IDLE, LOAD, NUM_IDLE_SAMPLES, SoakConfig, SoakResult
from loadtest.soak_traffic import CHAT, KIND_CLASS
from loadtest.stats import percentile

DPI = 80
RESOURCES_PLOT = "resources_over_time.png"
LATENCY_PLOT = "latency_over_time.png"
MIB = 1024 * 1024
DRIFT_RATIO = 1.5  # a last window's p90 TTFT over 1.5x the first's reads as drift
SERVER_ERRORS = ("500", "502", "504")  # a 5xx other than 503 (overload, shutdown) is a server bug


def margins(config: SoakConfig) -> dict[str, float]:
    """How far above its baseline each resource may stay once idle again; a missing key only reports."""
    return {"rss_bytes": config.rss_margin_bytes, "num_fds": config.fd_margin, "asyncio_tasks": config.task_margin,
            "kv_blocks_in_use": 0, "cpu_blocks_in_use": 0}


RESOURCES = ("rss_bytes", "num_fds", "num_threads", "asyncio_tasks", "kv_blocks_in_use", "cpu_blocks_in_use",
             "db_bytes", "wal_bytes", "metrics_bytes")


def _idle_value(samples: Sequence[Sample], phase: str, name: str) -> float | None:
    values = [getattr(s, name) for s in samples if s.phase == phase and getattr(s, name) is not None]
    return statistics.median(values[-NUM_IDLE_SAMPLES:]) if values else None


def resource_summary(samples: Sequence[Sample], config: SoakConfig) -> dict[str, dict[str, Any]]:
    limits = margins(config)
    summary: dict[str, dict[str, Any]] = {}
    for name in RESOURCES:
        baseline, after = _idle_value(samples, BASELINE, name), _idle_value(samples, IDLE, name)
        under_load = [getattr(s, name) for s in samples if s.phase == LOAD and getattr(s, name) is not None]
        entry: dict[str, Any] = {"baseline": baseline, "peak_under_load": max(under_load, default=None),
                                 "idle_after": after, "margin": limits.get(name)}
        if baseline is not None and after is not None:
            entry["growth"] = after - baseline
            entry["returned"] = after <= baseline + limits.get(name, 0)
            entry["checked"] = name in limits
        summary[name] = entry
    return summary


def latency_windows(records: Sequence[RequestRecord], start_s: float, end_s: float, window_s: float
                    ) -> list[dict[str, Any]]:
    """Per window of the load phase: TTFT of the interactive streamed chats, end-to-end time of every
    finished request, and the requests sent."""
    windows = []
    at = start_s
    while at < end_s:
        inside = [r for r in records if at <= r.sent_at < at + window_s]
        ttft = [r.ttft_s for r in inside if r.klass == CHAT and r.ttft_s is not None]
        e2e = [r.e2e_s for r in inside if r.outcome == "ok" and r.e2e_s is not None]
        windows.append({"start_s": round(at, 1), "sent": len(inside), "errors": sum(r.is_error for r in inside),
                        **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 90, 99)},
                        **{f"e2e_p{q}_s": percentile(e2e, q) for q in (50, 90)}})
        at += window_s
    return windows


def drift(windows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    full = [w for w in windows if w["ttft_p90_s"] is not None]
    if len(full) < 2:
        return {"first": None, "last": None, "ratio_p90": None, "drifts": None}
    first, last = full[0], full[-1]
    ratio = last["ttft_p90_s"] / first["ttft_p90_s"] if first["ttft_p90_s"] else None
    return {"first": first, "last": last, "ratio_p90": ratio, "drifts": ratio is not None and ratio > DRIFT_RATIO}


def by_kind(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, list[RequestRecord]] = {}
    for record in records:
        kinds.setdefault(record.klass, []).append(record)
    return {kind: {"sent": len(group), "outcomes": dict(sorted(Counter(r.outcome for r in group).items())),
                   "e2e_p50_s": percentile([r.e2e_s for r in group if r.e2e_s is not None], 50)}
            for kind, group in sorted(kinds.items())}


def failures(result: SoakResult, resources: dict[str, dict[str, Any]]) -> list[str]:
    found = [p for settled in result.settles for p in settled.problems]
    for name, entry in resources.items():
        if entry.get("checked") and not entry["returned"]:
            found.append(f"{name} did not come back: baseline {entry['baseline']:g}, idle after the load "
                         f"{entry['idle_after']:g} (margin {entry['margin']:g})")
        elif name in margins(result.config) and "returned" not in entry:
            found.append(f"{name} could not be read (is the server on this machine? pass --pid)")
    server_errors = Counter(r.outcome for r in result.traffic.records if r.outcome in SERVER_ERRORS)
    found += [f"{n} answer(s) {status}" for status, n in sorted(server_errors.items())]
    return found


def _delta(before: dict[str, Any], after: dict[str, Any], *keys: str) -> int:
    def dig(stats: dict[str, Any]) -> int:
        value: Any = stats
        for key in keys:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        return int(value) if isinstance(value, int | float) else 0
    return dig(after) - dig(before)


def build_soak_report(result: SoakResult) -> dict[str, Any]:
    config = result.config
    resources = resource_summary(result.samples, config)
    windows = latency_windows(result.traffic.records, result.load_started_at, result.load_ended_at, config.window_s)
    found = failures(result, resources)
    before, after = result.stats_before, result.stats_after
    return {
        "scenario": "soak", "passed": not found, "failures": found, "model": result.model,
        "config": {"url": config.url, "minutes": config.minutes, "clients": config.clients, "think_s": config.think_s,
                   "warmup_s": config.warmup_s, "sample_s": config.sample_s, "window_s": config.window_s,
                   "seed": config.seed, "tenants": [t.tenant_id for t in config.tenants]},
        "load_s": [round(result.load_started_at, 1), round(result.load_ended_at, 1)],
        "resources": resources, "latency_windows": windows, "latency_drift": drift(windows),
        "by_kind": by_kind(result.traffic.records),
        "failed_requests": failed_requests([({"kind": r.klass, "class": KIND_CLASS.get(r.klass, "-")}, r)
                                            for r in result.traffic.records if r.is_error]),
        "server_delta": {"requests_finished": _delta(before, after, "requests_finished"),
                         "requests_aborted": _delta(before, after, "requests_aborted"),
                         "preemptions_swap": _delta(before, after, "preemptions", "swap"),
                         "preemptions_recompute": _delta(before, after, "preemptions", "recompute"),
                         "blocks_swapped_out": _delta(before, after, "swap", "blocks_out")},
        "batches": result.traffic.batches,
        "settles": [s.to_json() | {"stats": None} for s in result.settles],
        "samples": [s.to_json() for s in result.samples],
    }


def _cell(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return f"{value / MIB:.1f} MiB"
    return f"{value:g}"


def soak_markdown(report: dict[str, Any], plots: Sequence[str] = ()) -> str:
    config = report["config"]
    verdict = "**Soak: passed**" if report["passed"] else "**Soak: FAILED**: " + "; ".join(report["failures"])
    lines = [f"# Soak: {config['minutes']:g} minutes", "",
             f"Server {config['url']}, model `{report['model']}`; {config['clients']} users (mean think "
             f"{config['think_s']:g} s), {config['warmup_s']:g} s of warm-up before the baseline, a sample every "
             f"{config['sample_s']:g} s.", "", verdict, "",
             "| resource | baseline (idle) | peak under load | idle after | growth | back to baseline |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, entry in report["resources"].items():
        back = "-" if "returned" not in entry else ("yes" if entry["returned"] else "NO")
        if "returned" in entry and not entry["checked"]:
            back += " (reported only)"
        lines.append(f"| {name} | {_cell(name, entry['baseline'])} | {_cell(name, entry['peak_under_load'])} | "
                     f"{_cell(name, entry['idle_after'])} | {_cell(name, entry.get('growth'))} | {back} |")
    lines += ["", "| window start (s) | sent | errors | chat TTFT p50/p90/p99 ms | E2E p50/p90 s |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for w in report["latency_windows"]:
        ttft = "/".join("-" if w[f"ttft_p{q}_s"] is None else f"{w[f'ttft_p{q}_s'] * 1000:.0f}" for q in (50, 90, 99))
        e2e = "/".join("-" if w[f"e2e_p{q}_s"] is None else f"{w[f'e2e_p{q}_s']:.2f}" for q in (50, 90))
        lines.append(f"| {w['start_s']:g} | {w['sent']} | {w['errors']} | {ttft} | {e2e} |")
    found = report["latency_drift"]
    if found["ratio_p90"] is not None:
        lines += ["", f"Latency drift: last window's p90 TTFT is {found['ratio_p90']:.2f}x the first's "
                      f"({'drifts' if found['drifts'] else 'no drift'}; drift is over {DRIFT_RATIO:g}x)."]
    lines += ["", "Requests by kind: " + "; ".join(
        f"{kind} {k['sent']} ({', '.join(f'{o} {n}' for o, n in k['outcomes'].items())})"
        for kind, k in report["by_kind"].items()),
        "", "Server counters during the run: " + ", ".join(f"{k} +{v}" for k, v in report["server_delta"].items())]
    lines += ["", *failed_requests_markdown(report["failed_requests"], ("kind", "class"))]
    lines += ["", *(f"![{Path(plot).stem}]({Path(plot).name})" for plot in plots)]
    return "\n".join(lines).rstrip() + "\n"


PLOTTED = (("rss_bytes", "RSS (MiB)", MIB), ("num_fds", "open fds", 1), ("num_threads", "threads", 1),
           ("asyncio_tasks", "asyncio tasks", 1), ("kv_blocks_in_use", "KV blocks in use", 1),
           ("cpu_blocks_in_use", "swap blocks in use", 1), ("db_bytes", "SQLite DB (MiB)", MIB),
           ("wal_bytes", "SQLite WAL (MiB)", MIB))


def resources_plot(report: dict[str, Any], path: Path) -> None:
    figure = Figure(figsize=(12, 6), dpi=DPI, layout="constrained")
    axes = figure.subplots(2, 4).flatten()
    samples = report["samples"]
    load_start, load_end = report["load_s"]
    for ax, (name, label, scale) in zip(axes, PLOTTED, strict=True):
        points = [(s["at_s"] / 60, s[name] / scale) for s in samples if s[name] is not None]
        if points:
            ax.plot(*zip(*points, strict=True), linewidth=1)
        ax.axvspan(load_start / 60, load_end / 60, color="tab:orange", alpha=0.1)
        ax.set_title(label, fontsize="small")
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
    figure.suptitle("soak: the server's resources (shaded: the load phase)")
    figure.savefig(path)


def latency_plot(report: dict[str, Any], path: Path) -> None:
    figure = Figure(figsize=(7, 3.2), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    windows = report["latency_windows"]
    for q in (50, 90, 99):
        points = [(w["start_s"] / 60, w[f"ttft_p{q}_s"]) for w in windows if w[f"ttft_p{q}_s"] is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=f"TTFT p{q}")
    ax.set_xlabel("window start (minutes)")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    figure.suptitle("soak: interactive chat TTFT per window")
    figure.savefig(path)


def write_soak_report(report: dict[str, Any], out_dir: Path) -> str:
    """report.json, summary.md and the plots into out_dir; returns the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [out_dir / RESOURCES_PLOT, out_dir / LATENCY_PLOT]
    resources_plot(report, plots[0])
    latency_plot(report, plots[1])
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    summary = soak_markdown(report, [str(p) for p in plots])
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    return summary
