"""`python -m loadtest mixed` against a real uvicorn on loopback (the instant executor, lengths scaled down):
every request of the seeded trace is sent at its time and streamed, the report holds TTFT mean and p99, the
longest bucket's p99 and the tenants' Jain index, and compares with an earlier report."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.__main__ import main
from loadtest.mixed import DOCUMENT_TOKENS, poisson_trace
from tests.app.conftest import ServerThread, instant_context, stepped_server
from tests.tenants_files import tenants_toml

KEYS = {"a": "fl-mixed-a-key", "b": "fl-mixed-b-key"}


def tenants_files(folder: Path) -> tuple[Path, Path]:
    """The server's tenants file with the two tenants of KEYS, and the load tool's for them."""
    tenants = folder / "tenants.toml"
    tenants.write_text(tenants_toml(KEYS))
    client = folder / "client.toml"
    client.write_text("".join(f'[[tenants]]\nid = "{t}"\napi_key = "{k}"\n\n' for t, k in KEYS.items()))
    return tenants, client


def two_tenant_server(folder: Path) -> tuple[ServerThread, Path]:
    """An instant server with the two tenants of KEYS, and the load tool's tenants file for them."""
    tenants, client = tenants_files(folder)
    return ServerThread(instant_context(tenants_file=str(tenants))).start(), client


@contextlib.contextmanager
def paced_two_tenant_server(folder: Path, step_s: float = 0.02) -> Iterator[tuple[ServerThread, Path]]:
    """The two tenants' server stepping once every `step_s`, so each request stays in flight for a few steps
    and the tenants' requests overlap: on an instant one a fast CPU ended each request before the other
    tenant's next arrived, and Jain (read while both are backlogged) had nothing to read in half the runs."""
    tenants, client = tenants_files(folder)
    server, executor = stepped_server(tenants)
    stopped = threading.Event()

    def pace() -> None:
        while not stopped.wait(step_s):
            executor.allow(1)

    pacer = threading.Thread(target=pace, daemon=True)
    pacer.start()
    try:
        yield server, client
    finally:
        stopped.set()
        pacer.join()
        executor.open()
        server.stop()


def test_the_trace_is_seeded_past_capacity_and_has_documents() -> None:
    trace = poisson_trace(600, seed=3, load=1.3, per_token_s=0.0018)
    assert trace == poisson_trace(600, seed=3, load=1.3, per_token_s=0.0018)
    offered = sum(0.0018 * (r.prompt_tokens + r.output_tokens) for r in trace) / 600
    assert 1.0 < offered < 1.7  # about 1.3 seconds of work a second
    assert {r.tenant for r in trace} == {0, 1}
    assert 0.02 < sum(r.prompt_tokens == DOCUMENT_TOKENS for r in trace) / len(trace) < 0.09


def test_the_command_sends_the_trace_and_compares_with_an_earlier_run(tmp_path: Path) -> None:
    with paced_two_tenant_server(tmp_path) as (server, client):
        args = ["mixed", "--url", server.base_url, "--tenants", str(client), "--duration", "3", "--scale", "0.02",
                "--tokens-per-s", "200"]
        assert main([*args, "--label", "first", "--out", str(tmp_path / "first")]) == 0
        assert main([*args, "--label", "second", "--out", str(tmp_path / "second"),
                     "--against", str(tmp_path / "first" / "report.json")]) == 0
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    summary = report["summary"]
    assert summary["requests"] > 5 and summary["errors"] == 0
    assert summary["ttft_mean_s"] is not None and summary["ttft_p99_s"] >= summary["ttft_p50_s"]
    assert summary["jain"] is not None and 0.5 <= summary["jain"] <= 1.0
    assert report["against"]["label"] == "first" and report["against"]["ratios"]["ttft_mean_s"] is not None
    rows = report["requests"]  # each request, in arrival order, with its lengths and what it waited
    assert len(rows) == summary["requests"] and [r["arrival_s"] for r in rows] == sorted(r["arrival_s"] for r in rows)
    assert all(r["outcome"] == "ok" and r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"] for r in rows)
    assert sum(r["ttft_s"] for r in rows) / len(rows) == pytest.approx(summary["ttft_mean_s"], abs=1e-2)
    # how far past what the server computed the run was: the trace's tokens over its 3 s, against what came back
    offered = sum(r["prompt_tokens"] + r["output_tokens"] for r in rows) / 3
    assert summary["offered_tokens_per_s"] == pytest.approx(offered)
    span_s = max(r["arrival_s"] + r["e2e_s"] for r in rows) - min(r["arrival_s"] for r in rows)
    assert summary["served_tokens_per_s"] == pytest.approx(offered * 3 / span_s, rel=0.1)  # every request ended
    assert summary["offered_over_served"] == pytest.approx(offered / summary["served_tokens_per_s"])
    assert "offered / served tok/s" in (tmp_path / "second" / "summary.md").read_text()


def test_the_capacity_is_measured_unless_given_and_a_comparison_runs_the_earlier_trace(tmp_path: Path) -> None:
    server, client = two_tenant_server(tmp_path)
    try:
        args = ["mixed", "--url", server.base_url, "--tenants", str(client), "--duration", "1", "--scale", "0.02",
                "--load", "0.1"]
        assert main([*args, "--out", str(tmp_path / "first")]) == 0
        earlier = str(tmp_path / "first" / "report.json")
        assert main([*args, "--out", str(tmp_path / "second"), "--against", earlier]) == 0
    finally:
        server.stop()
    first, second = (json.loads((tmp_path / run / "report.json").read_text()) for run in ("first", "second"))
    measured = first["measured_tokens_per_s"]
    assert measured > 0 and first["config"]["tokens_per_s"] == measured
    assert second["measured_tokens_per_s"] is None and second["config"]["tokens_per_s"] == measured
    arrivals = [[(r["arrival_s"], r["prompt_tokens"]) for r in report["requests"]] for report in (first, second)]
    assert arrivals[0] == arrivals[1] and len(arrivals[0]) > 0
