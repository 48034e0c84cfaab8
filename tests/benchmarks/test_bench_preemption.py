"""`fairlane bench preemption` end to end on builtin:tiny with a second of traffic, and its pure parts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_preemption import RUNS, Traffic, interactive_arrivals, judge
from benchmarks.cli import main
from loadtest.stats import percentile

TRAFFIC_FLAGS = ["--seed", "5", "--duration", "1.5", "--interactive-rate", "4", "--interactive-prompt-len", "16:40",
                 "--interactive-output-len", "4:10", "--batch-prompt-len", "16:32", "--batch-output-len", "16:32",
                 "--backlog", "6"]
TRAFFIC = Traffic(5, 1.5, 4.0, (16, 40), (4, 10), (16, 32), (16, 32), 6)


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    folder = tmp_path_factory.mktemp("bench")
    out, plot = folder / "preemption.json", folder / "preemption.png"
    # 16 float32 blocks of 16 tokens: six batch requests of up to 64 tokens do not fit, so they swap.
    code = main(["bench", "preemption", "--model", "builtin:tiny", "--kv-cache-bytes", str(8 * 65536),
                 "--kv-cache-dtype", "float32",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "64", *TRAFFIC_FLAGS,
                 "--out", str(out), "--plot", str(plot)])
    assert code == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report, plot


def test_every_run_serves_every_interactive_request(bench_files: tuple[dict[str, Any], Path]) -> None:
    report, _ = bench_files
    runs = report["runs"]
    assert list(runs) == [spec.name for spec in RUNS]
    num_arrivals = len(interactive_arrivals(TRAFFIC))
    assert report["traffic"]["interactive_requests"] == num_arrivals > 0
    for name in ("interactive_alone", "fcfs", "priority_swap", "priority_swap_budget"):
        inter = runs[name]["interactive"]
        assert inter["requests"] == num_arrivals, name
        assert 0 < inter["ttft_p50_s"] <= inter["ttft_p99_s"], name
        assert 0 < inter["itl_p50_s"] <= inter["itl_p99_s"], name
    assert runs["interactive_alone"]["batch"]["tokens"] == 0
    assert runs["batch_alone"]["interactive"]["requests"] == 0
    assert runs["batch_alone"]["window_s"] == pytest.approx(runs["interactive_alone"]["window_s"])
    for name in ("batch_alone", "fcfs", "priority_swap", "priority_swap_budget"):
        assert runs[name]["batch"]["tokens"] > 0, name


def test_priority_run_swaps_and_the_report_judges_the_targets(bench_files: tuple[dict[str, Any], Path]) -> None:
    report, _ = bench_files
    ours = report["runs"]["priority_swap"]
    assert ours["preemptions"]["swap"] > 0 and ours["swapped_out_bytes"] > 0
    targets = report["targets"]
    capacity = targets["capacity"]
    assert capacity["batch_capacity_tokens_per_s"] == pytest.approx(
        capacity["batch_alone_tokens_per_s"] * (1 - capacity["interactive_busy_share"]))
    assert 0 < capacity["interactive_busy_share"] < 1
    assert set(targets["met"]) == {"ttft_p99", "itl_p50", "itl_p99", "batch_capacity", "cost_model_error"}
    assert all(isinstance(met, bool) for met in targets["met"].values())
    budget = report["runs"]["priority_swap_budget"]["step_cost"]
    assert budget["shaped_steps"] > 0 and budget["median_error"] >= 0
    assert report["runs"]["priority_swap"]["step_cost"]["shaped_steps"] == 0  # shaping off there
    timeline = report["timeline"]["priority_swap"]
    assert len(timeline["batch_tokens_per_s"]) == len(timeline["interactive_tokens_per_s"]) >= 1


def test_the_timeline_is_a_png(bench_files: tuple[dict[str, Any], Path]) -> None:
    _, plot = bench_files
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arrivals_are_seeded_poisson_within_the_duration() -> None:
    arrivals = interactive_arrivals(Traffic(1, 50.0, 2.0, (8, 8), (4, 4), (8, 8), (4, 4), 1))
    assert arrivals == interactive_arrivals(Traffic(1, 50.0, 2.0, (8, 8), (4, 4), (8, 8), (4, 4), 1))
    times = [a.at_s for a in arrivals]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 50.0
    assert 70 <= len(arrivals) <= 130  # rate 2/s over 50 s: 100 expected


def test_percentile_interpolates_and_judge_compares_with_the_targets() -> None:
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)

    def run(ttft_p99: float | None, tokens_per_s: float, busy: float, itl: tuple[float, float] = (0.4, 0.5),
            error: float | None = None) -> dict[str, Any]:
        return {"interactive": {"ttft_p99_s": ttft_p99, "itl_p50_s": itl[0], "itl_p99_s": itl[1]},
                "batch": {"tokens_per_s": tokens_per_s}, "busy_share": busy, "step_cost": {"median_error": error}}

    verdict = judge({"interactive_alone": run(1.0, 0.0, 0.25), "batch_alone": run(None, 100.0, 0.0),
                     "priority_swap_budget": run(1.6, 70.0, 0.0, itl=(0.5, 1.2), error=0.1)})
    assert verdict["capacity"]["batch_capacity_tokens_per_s"] == pytest.approx(75.0)
    ours = verdict["runs"]["priority_swap_budget"]
    assert ours["ttft_p99_ratio"] == pytest.approx(1.6) and not verdict["met"]["ttft_p99"]
    assert ours["itl_p50_ratio"] == pytest.approx(1.25) and verdict["met"]["itl_p50"]
    assert ours["itl_p99_ratio"] == pytest.approx(2.4) and not verdict["met"]["itl_p99"]
    assert ours["batch_capacity_fraction"] == pytest.approx(70 / 75) and verdict["met"]["batch_capacity"]
    assert verdict["met"]["cost_model_error"]
