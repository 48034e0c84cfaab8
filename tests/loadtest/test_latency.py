"""`python -m loadtest latency` against a real uvicorn on loopback (the instant executor): every phase runs
its streams, the report holds TTFT and ITL per phase with their ratios to the alone phase, batch streams'
tokens are counted, and the command writes its report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from loadtest.__main__ import main
from loadtest.client import RequestRecord
from loadtest.latency import PHASES, LatencyConfig, build_latency_report, latency_table, run_latency, tokens_within
from loadtest.workload import ANONYMOUS
from tests.app.conftest import ServerThread, instant_context


def test_every_phase_runs_and_the_report_compares_it_with_one_stream_alone() -> None:
    server = ServerThread(instant_context()).start()
    try:
        config = LatencyConfig(server.base_url, ANONYMOUS, phase_seconds=1.5, interactive_streams=2,
                               batch_streams=2, prompt_words=10, max_tokens=8, warmup_s=0.2)
        phases = asyncio.run(run_latency(config))
    finally:
        server.stop()
    report = build_latency_report(config, phases, (0.0, 0.0))
    assert list(report["phases"]) == list(PHASES)
    for name, summary in report["phases"].items():
        assert summary["errors"] == 0 and summary["interactive_requests"] > 0, name
        assert summary["ttft_p50_s"] is not None and summary["itl_p50_s"] is not None
    assert report["phases"]["flood"]["batch_tokens_per_s"] > 0
    assert report["phases"]["interactive"]["batch_tokens_per_s"] == 0
    assert set(report["ratios_to_alone"]) >= {"interactive.ttft_p50", "flood.ttft_p99", "flood.itl_p50"}
    assert "against alone" in latency_table(report)


def test_the_command_refuses_an_unknown_phase_and_a_remote_url(tmp_path: Path) -> None:
    assert main(["latency", "--url", "http://127.0.0.1:9", "--phases", "alone,sideways",
                 "--out", str(tmp_path)]) == 2
    assert main(["latency", "--url", "http://10.1.2.3:8000", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "report.json").exists()


def test_the_command_writes_its_report(tmp_path: Path) -> None:
    server = ServerThread(instant_context()).start()
    try:
        code = main(["latency", "--url", server.base_url, "--phases", "alone", "--phase-seconds", "1",
                     "--prompt-words", "8", "--max-tokens", "4", "--warmup", "0.2", "--out", str(tmp_path)])
    finally:
        server.stop()
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["phases"]["alone"]["interactive_requests"] > 0 and report["passed"]


def test_phases_run_on_fresh_servers_join_one_report_with_their_ratios_and_the_peers_batch(tmp_path: Path) -> None:
    """Each phase on its own server: the last run's report takes the earlier reports' phases (`--with`) and
    compares them with the alone phase; a peer's report (`--peer`) gives the flood's batch against its own,
    and a batch below half the peer's is a miss."""
    server = ServerThread(instant_context()).start()
    common = ["--url", server.base_url, "--phase-seconds", "1", "--prompt-words", "8", "--max-tokens", "4",
              "--warmup", "0.2", "--interactive-streams", "2", "--batch-streams", "2"]
    try:
        assert main(["latency", *common, "--phases", "alone", "--out", str(tmp_path / "alone")]) == 0
        code = main(["latency", *common, "--phases", "flood", "--out", str(tmp_path / "flood"),
                     "--with", str(tmp_path / "alone" / "report.json")])
        assert code in (0, 1)  # 1: a ratio past its target, which the instant executor's timings may be
    finally:
        server.stop()
    report = json.loads((tmp_path / "flood" / "report.json").read_text())
    assert list(report["phases"]) == ["alone", "flood"]
    alone, flood = report["phases"]["alone"], report["phases"]["flood"]
    assert report["ratios_to_alone"]["flood.ttft_p50"] == flood["ttft_p50_s"] / alone["ttft_p50_s"]
    assert report["batch_vs_peer"] is None

    config = LatencyConfig("http://127.0.0.1:9", ANONYMOUS, phases=("flood",))
    peer = json.loads(json.dumps(report))
    ours = report["phases"]["flood"]["batch_tokens_per_s"]
    peer["phases"]["flood"]["batch_tokens_per_s"] = 4 * ours
    combined = build_latency_report(config, [], (0.0, 0.0), [report], peer)
    assert combined["batch_vs_peer"] == 0.25 and not combined["passed"]
    assert any(m.startswith("flood.batch_vs_peer") for m in combined["missed"])
    assert "against the peer's" in latency_table(combined)
    peer["phases"]["flood"]["batch_tokens_per_s"] = 1.5 * ours
    assert build_latency_report(config, [], (0.0, 0.0), [report], peer)["batch_vs_peer"] > 0.5


def test_a_streams_tokens_are_counted_where_they_were_made_even_when_chunks_carry_several() -> None:
    """Ten tokens in four chunks (the server coalesced a stream that fell behind): all ten are counted, those
    of the part of the stream within the window only."""
    record = RequestRecord("t", "batch", 0.0, chunk_times=[1.0, 2.0, 3.0, 10.0], completion_tokens=10)
    assert tokens_within(record, 0.0, 20.0) == 10
    assert tokens_within(record, 5.5, 20.0) == 4.5  # nine tokens after the first, spread over 1 to 10 s
    assert tokens_within(record, 0.0, 0.5) == 0
    one_chunk = RequestRecord("t", "batch", 0.0, chunk_times=[1.0], completion_tokens=3)
    assert tokens_within(one_chunk, 0.0, 2.0) == 3 and tokens_within(one_chunk, 1.5, 2.0) == 0
    no_usage = RequestRecord("t", "batch", 0.0, chunk_times=[1.0, 2.0])  # no usage: a token a chunk
    assert tokens_within(no_usage, 0.0, 2.0) == 2
