"""PNG plots of a load run: latency CDFs per class, and each tenant's output throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from loadtest.client import OK, RequestRecord
from loadtest.workload import BATCH_API

DPI = 80
LATENCY_PLOT = "latency_cdf.png"
THROUGHPUT_PLOT = "tenant_throughput.png"


def _latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    served = [r for r in records if not r.is_error]
    return {
        "TTFT (s)": [r.ttft_s for r in served if r.ttft_s is not None],
        "inter-token latency (s)": [b - a for r in served if r.klass != BATCH_API for a, b in pairwise(r.chunk_times)],
        "end to end (s)": [r.e2e_s for r in records if r.outcome == OK and r.e2e_s is not None],
    }


def latency_cdf_plot(records: Sequence[RequestRecord], path: Path, title: str) -> None:
    figure = Figure(figsize=(10, 3.2), dpi=DPI, layout="constrained")
    axes = figure.subplots(1, 3)
    classes = sorted({r.klass for r in records})
    for klass in classes:
        for ax, (label, values) in zip(axes, _latencies([r for r in records if r.klass == klass]).items(),
                                       strict=True):
            ax.set_xlabel(label)
            if values:
                ordered = sorted(values)
                ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=klass)
    axes[0].set_ylabel("fraction of requests")
    for ax in axes:
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if classes:
        axes[0].legend(fontsize="small")
    figure.suptitle(title)
    figure.savefig(path)


def throughput_plot(series: dict[str, Any], path: Path, title: str) -> None:
    figure = Figure(figsize=(7, 3.2), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    bucket_s = series["bucket_s"]
    for tenant, values in series["tenants"].items():
        ax.plot([(i + 0.5) * bucket_s for i in range(len(values))], values, label=tenant)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    figure.suptitle(title)
    figure.savefig(path)


def write_plots(records: Sequence[RequestRecord], report: dict[str, Any], out_dir: Path) -> list[str]:
    """Draw both plots into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    scenario = report["scenario"]
    latency_path, throughput_path = out_dir / LATENCY_PLOT, out_dir / THROUGHPUT_PLOT
    latency_cdf_plot(records, latency_path, f"{scenario}: latency CDFs by class")
    throughput_plot(report["throughput_over_time"], throughput_path, f"{scenario}: output tokens/s by tenant")
    return [str(latency_path), str(throughput_path)]
