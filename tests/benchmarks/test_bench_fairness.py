"""`fairlane bench fairness` at a small scale: the command runs, and its report holds together."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.bench_fairness import FairnessWorkload, RpmLimiter, TenantLoad, make_arrivals
from benchmarks.cli import main
from loadtest.stats import jain_index, percentile

README = Path(__file__).resolve().parents[2] / "docs" / "tenancy.md"  # where the fairness table is
README_COMMAND = ".venv/bin/fairlane bench fairness --out data/bench_fairness.json --plot data/bench_fairness.png"


def readme_output_of(command: str) -> str:
    """The README's code block that follows the block showing `command`: what the command printed."""
    text = README.read_text(encoding="utf-8")
    after_command = text[text.index(command):]
    after_its_block = after_command[after_command.index("```") + 3:]
    found = re.search(r"```\n(.*?)\n```", after_its_block, flags=re.DOTALL)
    assert found is not None, f"no output block after {command!r} in {README.name}"
    return found[1]


def test_bench_fairness_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "fairness.json", tmp_path / "fairness.png"
    assert main(["bench", "fairness", "--duration", "10", "--rpm-limit", "30", "--out", str(out),
                 "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "vtc_without_heavy" in table and "light-1" in table and "jain" in table
    report = json.loads(out.read_text())
    systems = report["systems"]
    assert set(systems) == {"vtc", "fcfs", "rpm", "vtc_without_heavy"}
    vtc, fcfs, rpm = systems["vtc"], systems["fcfs"], systems["rpm"]
    assert vtc["backlogged"] == ["heavy", "steady"]
    assert vtc["jain_index"] >= 0.99 > fcfs["jain_index"]
    shares = {t: v["share_of_service"] for t, v in vtc["tenants"].items()}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["steady"] > 1.5 * shares["heavy"]  # weight 2 against weight 1, both backlogged
    assert report["throughput_ratio_vtc_to_fcfs"] >= 0.95
    assert "heavy" not in systems["vtc_without_heavy"]["tenants"]
    assert rpm["requests_rejected"] == sum(t["requests_rejected"] for t in rpm["tenants"].values())
    assert rpm["tenants"]["heavy"]["requests_rejected"] > 0 == rpm["tenants"]["light-1"]["requests_rejected"]
    assert vtc["requests_rejected"] == 0
    light_vtc, light_fcfs = vtc["tenants"]["light-1"], fcfs["tenants"]["light-1"]
    assert light_vtc["ttft_p50_s"] <= light_vtc["ttft_p99_s"] < light_fcfs["ttft_p50_s"]
    assert set(report["targets"]) == {"vtc_jain_index_at_least_0.99", "light_ttft_p99_within_2x_of_without_heavy",
                                      "vtc_throughput_within_5pct_of_fcfs"}
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_arrivals_are_seeded_and_per_tenant() -> None:
    tenants = (TenantLoad("heavy", 1.0, 10.0), TenantLoad("light", 1.0, 1.0))
    workload = FairnessWorkload(tenants, duration_s=20.0, seed=3)
    arrivals = make_arrivals(workload)
    assert arrivals == make_arrivals(workload)
    assert arrivals != make_arrivals(FairnessWorkload(tenants, duration_s=20.0, seed=4))
    assert [a.time for a in arrivals] == sorted(a.time for a in arrivals)
    assert all(0 <= a.time < 20.0 and 32 <= a.prompt_len <= 512 for a in arrivals)
    counts = {t.tenant_id: sum(a.tenant_id == t.tenant_id for a in arrivals) for t in tenants}
    assert 5 * counts["light"] < counts["heavy"]
    light_only = make_arrivals(FairnessWorkload(tenants[1:], duration_s=20.0, seed=3))
    assert light_only == [a for a in arrivals if a.tenant_id == "light"]  # leaving a tenant out changes no one else


def test_rpm_limiter_counts_a_sliding_minute_per_tenant() -> None:
    limiter = RpmLimiter(2)
    assert limiter.allow("a", 0.0) and limiter.allow("a", 30.0)
    assert not limiter.allow("a", 59.0)
    assert limiter.allow("b", 59.0)  # another tenant's budget
    assert limiter.allow("a", 60.5)  # the request at 0.0 has left the window
    assert not limiter.allow("a", 61.0)


def test_jain_index_and_percentile() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile([float(x) for x in range(1, 101)], 99) == pytest.approx(99.01)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the full default trace: a few minutes on a small machine
def test_readme_table_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """In virtual time the output is exact, so README's table is checked line for line: a change that
    moves any number fails here until README shows the new output."""
    assert main(["bench", "fairness"]) == 0
    assert capsys.readouterr().out.strip() == readme_output_of(README_COMMAND).strip()
