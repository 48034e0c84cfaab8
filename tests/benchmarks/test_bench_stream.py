"""`fairlane bench stream` end to end, at a size that takes seconds: a real server process, real clients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cli import main


def test_bench_stream_reports_each_level(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench_stream.json"

    assert main(["bench", "stream", "--concurrency", "1,4", "--duration-s", "0.2", "--max-tokens", "16",
                 "--coalesce", "on", "--out", str(out)]) == 0

    report = json.loads(out.read_text())
    assert [(r["coalesce"], r["concurrency"]) for r in report["results"]] == [(True, 1), (True, 4)]
    for result in report["results"]:
        assert result["num_tokens"] == 16 * result["num_streams"] > 0
        assert result["tokens_per_s"] > 0 and result["server_cpu_s"] > 0
    table = capsys.readouterr().out
    assert "tokens/s" in table and "server CPU us/token" in table
