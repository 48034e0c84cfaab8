"""`fairlane bench scheduler` at a small scale: the command runs, keeps its workload topped up, and
reports times that are real measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_scheduler import RequestSource, SchedulerWorkload
from benchmarks.cli import main
from scheduling.request import PriorityClass

SMALL = ["--steps", "20", "--warmup-steps", "10", "--running", "16", "--waiting", "48", "--tenants", "6"]


@pytest.mark.parametrize("batch_share", [0.0, 0.5])
def test_bench_scheduler_reports_per_step_times(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                batch_share: float) -> None:
    out = tmp_path / "scheduler.json"
    assert main(["bench", "scheduler", *SMALL, "--batch-share", str(batch_share), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "schedule + update" in table and "p99 ms" in table

    report = json.loads(out.read_text())
    assert report["benchmark"] == "scheduler"
    assert (report["steps"], report["warmup_steps"]) == (20, 10)
    assert report["workload"]["num_tenants"] == 6 and report["workload"]["batch_share"] == batch_share
    assert report["scheduler"]["max_num_seqs"] == 16
    assert 0 < report["running_mean"] <= 16
    assert report["running_mean"] + report["waiting_mean"] == pytest.approx(16 + 48)  # topped up every step
    assert set(report["per_step_ms"]) == {"schedule_and_update", "schedule", "update", "snapshot_and_cost_model",
                                         "paced_gc_while_runner_computes", "per_request_objects_floor"}
    for name, ms in report["per_step_ms"].items():
        assert 0 < ms["p50"] <= ms["p99"] <= ms["max"], name
    total, schedule, update = (report["per_step_ms"][k]["max"] for k in ("schedule_and_update", "schedule", "update"))
    assert max(schedule, update) <= total
    assert isinstance(report["targets"]["p99_under_1ms"], bool)


def test_request_source_is_seeded_and_spreads_tenants_and_classes() -> None:
    workload = SchedulerWorkload(num_tenants=4, batch_share=0.5, seed=7)
    first, again = RequestSource(workload), RequestSource(workload)
    requests = [first.next_request() for _ in range(200)]
    assert [(r.request_id, r.prompt_token_ids, r.max_tokens, r.tenant_id, r.priority) for r in requests] == [
        (r.request_id, r.prompt_token_ids, r.max_tokens, r.tenant_id, r.priority)
        for r in (again.next_request() for _ in range(200))]
    assert len({r.request_id for r in requests}) == 200
    assert {r.tenant_id for r in requests} == {"tenant-000", "tenant-001", "tenant-002", "tenant-003"}
    assert {r.priority for r in requests} == set(PriorityClass)
    assert all(32 <= r.num_prompt_tokens <= 256 and 16 <= r.max_tokens <= 128 for r in requests)
