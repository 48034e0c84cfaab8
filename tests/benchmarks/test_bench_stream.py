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


def test_bench_stream_runs_each_stream_interval(tmp_path: Path) -> None:
    out = tmp_path / "bench_stream.json"

    assert main(["bench", "stream", "--concurrency", "2", "--duration-s", "0.2", "--max-tokens", "33",
                 "--coalesce", "off", "--stream-interval", "1,8", "--out", str(out)]) == 0

    every_token, by_eight = json.loads(out.read_text())["results"]
    assert (every_token["stream_interval"], by_eight["stream_interval"]) == (1, 8)
    # Per stream: the role chunk, the first token, 32 tokens in four events, the finish reason and the usage.
    assert by_eight["num_events"] == 8 * by_eight["num_streams"]
    assert every_token["num_events"] > 30 * every_token["num_streams"]
