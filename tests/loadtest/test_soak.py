"""`python -m loadtest soak`: the report's arithmetic on made-up samples, and (slow) a soak of a real
`fairlane serve --model builtin:tiny` process that fails on a leak: RSS past a margin after the
warm-up, a KV block held once idle, file descriptors or asyncio tasks that grow.

The slow soak proves the mechanism, not endurance: 30 s (6 s of warm-up, then 24 s of load) with one
user per kind of traffic, so every kind is sent even on a slow machine. LOADTEST_SOAK_MINUTES
sets another length; the hour-long soak is a benchmark, run by hand (docs/loadtest.md)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.batch_job import BATCH_ITEM_ERROR, run_batch_job
from loadtest.client import BAD_STREAM, ERROR_RESPONSE, NOT_JSON, TIMEOUT, RequestRecord, SettleResult
from loadtest.commands import run_long
from loadtest.failed_requests import MAX_LISTED, MAX_ROWS
from loadtest.probe import Sample, open_files, proc_status, sqlite_files
from loadtest.soak import BASELINE, IDLE, LOAD, SoakConfig, SoakResult
from loadtest.soak_report import build_soak_report, drift, latency_windows, soak_markdown
from loadtest.soak_traffic import (
    BATCH_JOB,
    CHAT,
    COMPLETION,
    DISCONNECT,
    FLEX_CHAT,
    KIND_CLASS,
    MIX,
    Traffic,
    post_once,
)
from loadtest.tenants import main as tenants_main
from loadtest.workload import BATCH_API, LoadTenant, batch_request
from tests.app.conftest import wait_for
from tests.conftest import REPO_ROOT

FAIRLANE = Path(sys.executable).with_name("fairlane")
STARTED_LINE = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
MiB = 1024 * 1024
ADMIN_KEY = "fl-soak-operator"
CLIENT_TENANTS = f"""
[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
id = "alice"
api_key = "fl-alice-soak"
weight = 2

[[tenants]]
id = "bob"
api_key = "fl-bob-soak"
"""
SOAK_MINUTES = float(os.environ.get("LOADTEST_SOAK_MINUTES", "0.5"))
RSS_MARGIN_MIB = 64
# 96 blocks of 16 tokens of builtin:tiny: about 1,500 tokens, so a few long prompts fill it and preempt.
KV_CACHE_BYTES = 3 * MiB


def sample(phase: str, at_s: float, rss_mib: float, fds: int = 20, tasks: int = 10, kv: int = 0) -> Sample:
    return Sample(at_s, phase, int(rss_mib * MiB), fds, 12, tasks, 0, 0, kv, 0, 0, 4096, 0, 1000)


def result_of(samples: list[Sample], records: list[RequestRecord] | None = None) -> SoakResult:
    config = SoakConfig("http://127.0.0.1:1", minutes=2, warmup_s=10, window_s=10)
    traffic = Traffic(httpx.AsyncClient(), "m", 0.0, records or [])
    idle = SettleResult(True, 0.1, [], {})
    return SoakResult(config, "m", traffic, samples, 10.0, 40.0, {}, {}, [idle, idle])


def phases(baseline_mib: float, after_mib: float, **after: int) -> list[Sample]:
    return ([sample(BASELINE, t, baseline_mib) for t in (1, 2, 3)] + [sample(LOAD, 20, baseline_mib + 200)]
            + [sample(IDLE, t, after_mib, **after) for t in (50, 51, 52)])


def test_a_server_back_at_its_baseline_passes() -> None:
    report = build_soak_report(result_of(phases(500, 500 + RSS_MARGIN_MIB - 1)))

    assert report["passed"], report["failures"]
    assert report["resources"]["rss_bytes"]["peak_under_load"] == 700 * MiB
    assert all(entry["returned"] for entry in report["resources"].values() if "returned" in entry)


@pytest.mark.parametrize(("after", "culprit"), [
    ({"rss_mib": 500 + RSS_MARGIN_MIB + 1}, "rss_bytes"), ({"fds": 30}, "num_fds"), ({"tasks": 20}, "asyncio_tasks"),
    ({"kv": 3}, "kv_blocks_in_use")])
def test_each_leak_fails_the_soak(after: dict[str, Any], culprit: str) -> None:
    rss_mib = after.pop("rss_mib", 500)
    report = build_soak_report(result_of(phases(500, rss_mib, **after)))

    assert not report["passed"]
    assert [f for f in report["failures"] if f.startswith(culprit)], report["failures"]
    assert "NO" in soak_markdown(report)


def chat(sent_at: float, ttft_s: float) -> RequestRecord:
    return RequestRecord("alice", CHAT, sent_at, "ok", ttft_s, ttft_s + 1, [sent_at + ttft_s])


def test_latency_windows_and_drift() -> None:
    records = [chat(12, 0.1), chat(15, 0.2), chat(25, 0.1), chat(35, 0.5), chat(36, 0.6)]
    windows = latency_windows(records, 10, 40, 10)
    found = drift(windows)

    assert [w["sent"] for w in windows] == [2, 1, 2]
    assert windows[0]["ttft_p50_s"] == pytest.approx(0.15)
    assert found["drifts"] and found["ratio_p90"] == pytest.approx(0.59 / 0.19)


ALICE = LoadTenant("alice", "fl-alice")


def answering(status: int, body: dict[str, Any]) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body, headers={"x-request-id": "req-9"}))


@pytest.mark.parametrize(("status", "body", "outcome", "completion_id", "reason", "detail"), [
    (200, {"id": "cmpl-9", "usage": {"prompt_tokens": 5, "completion_tokens": 2}}, "ok", "cmpl-9", None, None),
    (400, {"error": {"message": "too long for the pool"}}, "400", None, ERROR_RESPONSE, "too long for the pool"),
])
async def test_a_non_streamed_request_keeps_its_ids_and_what_refused_it(
        status: int, body: dict[str, Any], outcome: str, completion_id: str | None, reason: str | None,
        detail: str | None) -> None:
    async with httpx.AsyncClient(transport=answering(status, body), base_url="http://127.0.0.1:1") as http:
        traffic = Traffic(http, "m", 0.0)
        record = traffic.record(ALICE, COMPLETION)
        await post_once(traffic, "/v1/completions", {}, ALICE, record)

    assert (record.outcome, record.status, record.request_id, record.completion_id) == (outcome, status, "req-9",
                                                                                        completion_id)
    assert (record.reason, record.detail, record.num_bytes > 0) == (reason, detail, True)


def batch_api(request: httpx.Request) -> httpx.Response:
    """A Batch API whose batch completes at once: item 0 served, item 1 refused, item 2 failed."""
    output = {"custom_id": "alice-0", "response": {"status_code": 200, "request_id": "chatcmpl-0", "body": {
        "usage": {"prompt_tokens": 4, "completion_tokens": 2}}}, "error": None}
    refused = {"custom_id": "alice-1", "response": {"status_code": 400, "request_id": "chatcmpl-1", "body": {
        "error": {"message": "too long"}}}, "error": None}
    failed = {"custom_id": "alice-2", "response": None, "error": {"code": "batch_expired", "message": "expired"}}
    answers: dict[str, Any] = {
        "/v1/files": {"id": "file-in"}, "/v1/batches": {"id": "batch-1", "status": "validating"},
        "/v1/batches/batch-1": {"id": "batch-1", "status": "completed", "output_file_id": "file-out",
                                "error_file_id": "file-err"},
        "/v1/files/file-out/content": json.dumps(output), "/v1/files/file-err/content": "\n".join(
            json.dumps(line) for line in (refused, failed))}
    answer = answers[request.url.path]
    return httpx.Response(200, text=answer) if isinstance(answer, str) else httpx.Response(200, json=answer)


async def test_each_batch_item_keeps_its_completion_id_and_what_failed_it() -> None:
    items = [batch_request(ALICE, random.Random(i), BATCH_API) for i in range(3)]
    records = [RequestRecord("alice", BATCH_JOB, 0.0) for _ in items]
    async with httpx.AsyncClient(transport=httpx.MockTransport(batch_api), base_url="http://127.0.0.1:1") as http:
        await run_batch_job(http, "m", items, records, lambda: 1.0, [])

    assert [(r.outcome, r.status, r.completion_id, r.reason, r.detail) for r in records] == [
        ("ok", 200, "chatcmpl-0", None, None), ("400", 400, "chatcmpl-1", ERROR_RESPONSE, "too long"),
        ("batch_expired", None, None, BATCH_ITEM_ERROR, "expired")]


async def test_a_refused_batch_job_gives_each_item_the_refusal() -> None:
    items = [batch_request(ALICE, random.Random(i), BATCH_API) for i in range(2)]
    records = [RequestRecord("alice", BATCH_JOB, 0.0) for _ in items]
    transport = answering(413, {"error": {"message": "the file is too large"}})
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1") as http:
        await run_batch_job(http, "m", items, records, lambda: 1.0, [])

    assert [(r.outcome, r.status, r.request_id, r.reason, r.detail, r.e2e_s) for r in records] == [
        ("413", 413, "req-9", ERROR_RESPONSE, "the file is too large", 1.0)] * 2


def failed(kind: str, sent_at: float, outcome: str, reason: str, detail: str | None = None) -> RequestRecord:
    record = RequestRecord("bob", kind, sent_at, e2e_s=2.0, status=200, completion_id=f"chatcmpl-{sent_at:g}",
                           num_events=4, num_bytes=900)
    record.fail(outcome, reason, detail)
    return record


def test_the_report_lists_each_request_that_did_not_end_ok() -> None:
    records = [chat(12, 0.1), RequestRecord("alice", DISCONNECT, 13, "dropped"),
               failed(CHAT, 14, BAD_STREAM, NOT_JSON, '{"choices": [{"delta": {"content": "a|b\u2028'),
               failed(FLEX_CHAT, 15, TIMEOUT, "ReadTimeout")]
    report = build_soak_report(result_of(phases(500, 500), records))
    summary = soak_markdown(report)

    assert report["passed"]  # a failed request is listed; whether it fails the soak is for the verdicts to say
    assert report["failed_requests"]["count"] == 2
    first, second = report["failed_requests"]["listed"]
    assert (first["kind"], first["class"], first["tenant"], first["sent_at_s"]) == (CHAT, "interactive", "bob", 14)
    assert (first["outcome"], first["reason"], first["completion_id"]) == (BAD_STREAM, NOT_JSON, "chatcmpl-14")
    assert (second["kind"], second["class"], second["reason"]) == (FLEX_CHAT, "batch", "ReadTimeout")
    assert "Requests that did not end ok: 2 (all in report.json)." in summary
    # The chunk's separator and pipe are escaped: the row stays one row of the table.
    assert (r'| 14.0 | 2.00 | chat | interactive | bob | 200 | bad_stream | chunk not JSON | 4 / 900 | chatcmpl-14 | '
            r'`{"choices": [{"delta": {"content": "a\|b\u2028` |') in summary


def test_the_list_of_failed_requests_is_capped() -> None:
    records = [failed(CHAT, 20 + i / 10, BAD_STREAM, NOT_JSON, "x" * 300) for i in range(MAX_LISTED + 5)]
    report = build_soak_report(result_of(phases(500, 500), records))
    summary = soak_markdown(report)
    table = [line for line in summary.splitlines() if "| chat | interactive |" in line]

    assert report["failed_requests"]["count"] == MAX_LISTED + 5
    assert len(report["failed_requests"]["listed"]) == MAX_LISTED and len(table) == MAX_ROWS
    assert f"did not end ok: {MAX_LISTED + 5} (the first 20 below, the first 200 in report.json)." in summary
    assert all(len(row["detail"]) == 200 for row in report["failed_requests"]["listed"])


def test_a_soak_without_failed_requests_says_so() -> None:
    report = build_soak_report(result_of(phases(500, 500), [chat(12, 0.1)]))

    assert report["failed_requests"] == {"count": 0, "listed": []}
    assert "Requests that did not end ok: none." in soak_markdown(report)
    assert set(KIND_CLASS) == set(MIX)


def test_the_probe_reads_this_process() -> None:
    status = proc_status(os.getpid())

    assert status["rss_bytes"] > MiB and status["num_threads"] >= 1
    assert len(open_files(os.getpid())) >= 3
    assert sqlite_files(["/x/fairlane.db", "socket:[1]"]) == (None, None)  # not there: no sizes


@pytest.fixture
def soak_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`fairlane serve --model builtin:tiny` as its own process (so /proc/PID is the server alone),
    with a KV budget small enough that the traffic preempts batch-class streams by swap. The tiny model
    keeps every request short, so the drains at the end of each phase take seconds: what is soaked is
    the server's code, the same whatever the model's size."""
    client_file, server_file = tmp_path / "client.toml", tmp_path / "server.toml"
    client_file.write_text(CLIENT_TENANTS)
    assert tenants_main([str(client_file), str(server_file)]) == 0
    # PYTHONPATH: the server runs this checkout's code even where the installed package points elsewhere.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "FAIRLANE_BATCH_DB_PATH": str(tmp_path / "fairlane.db"),
           "FAIRLANE_BATCH_POLL_S": "0.2",
           # 32 swap blocks: preemptions swap until it fills, then recompute. A swap pool is an anonymous
           # mapping that counts in RSS once touched, so a small one keeps what the load touches past the warm-up
           # well under the RSS margin.
           "FAIRLANE_SWAP_SPACE_BYTES": str(2 * MiB),
           # A fixed threshold: glibc serves every block of 128 KiB or more (tensors) by mmap and unmaps it when
           # freed, instead of raising the threshold and keeping freed tensors in its heap. RSS then follows what
           # the server holds, not the largest step it ran, so a short warm-up gives a baseline a leak stands out from.
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    process = subprocess.Popen([str(FAIRLANE), "serve", "--model", "builtin:tiny", "--port", "0",
                                "--tenants", str(server_file), "--kv-cache-bytes", str(KV_CACHE_BYTES)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    found: list[str] = []

    def read_log() -> None:
        assert process.stderr is not None
        with process.stderr:
            for line in process.stderr:
                log.append(line)
                if not found and (started := STARTED_LINE.search(line)):
                    found.append(started[1])

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        wait_for(lambda: bool(found) or process.poll() is not None, timeout=120, interval=0.2,
                 what="the server to start")
        assert process.poll() is None, "".join(log[-50:])
        yield found[0], client_file
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_MINUTES * 60) + 600)  # the run, the server's start, the drains and the settles
def test_a_soak_of_a_real_server_leaks_nothing(soak_server: tuple[str, Path], tmp_path: Path) -> None:
    url, client_file = soak_server
    out = tmp_path / "soak"
    warmup_s = min(60.0, SOAK_MINUTES * 60 / 5)
    code = run_long(["soak", "--url", url, "--tenants", str(client_file), "--out", str(out),
                     "--minutes", str(SOAK_MINUTES), "--warmup", str(warmup_s), "--sample", "2",
                     "--window", str(max(10.0, SOAK_MINUTES * 60 / 5)), "--clients", str(len(MIX)), "--think", "1",
                     "--rss-margin-mib", str(RSS_MARGIN_MIB)])
    report = json.loads((out / "report.json").read_text())

    assert code == 0, report["failures"]
    resources = report["resources"]
    for name in ("rss_bytes", "num_fds", "asyncio_tasks", "kv_blocks_in_use", "cpu_blocks_in_use"):
        assert resources[name]["checked"] and resources[name]["returned"], (name, resources[name])
    assert resources["db_bytes"]["baseline"] is not None  # the probe found the server's SQLite file
    assert set(report["by_kind"]) == set(MIX)  # every kind of traffic was sent
    assert report["server_delta"]["preemptions_swap"] > 0  # the pool is small enough: swap was soaked too
    assert (out / "resources_over_time.png").read_bytes().startswith(b"\x89PNG")


def test_config_refuses_a_warmup_longer_than_the_run() -> None:
    config = SoakConfig("http://127.0.0.1:1", minutes=1)
    with pytest.raises(ValueError, match="warm-up"):
        replace(config, warmup_s=60).check()


async def test_users_that_share_the_kinds_out_send_every_kind_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """However few requests a slow run allows, every kind is sent once each user has sent its share."""
    from loadtest import soak_traffic

    sent: list[str] = []

    async def record_kind(traffic: Traffic, kind: str, tenant: LoadTenant, rng: random.Random) -> None:
        sent.append(kind)
        traffic.is_sending = len(sent) < 2 * len(MIX)

    monkeypatch.setattr(soak_traffic, "send_kind", record_kind)
    kinds, num_users = list(MIX), 3
    tenant = LoadTenant("alice", "key", 1.0)
    for i in range(num_users):
        sent.clear()
        traffic = Traffic(None, "m", 0.0)  # type: ignore[arg-type]  # never used: send_kind is replaced
        await soak_traffic.user(traffic, tenant, random.Random(i), 0.0, kinds[i::num_users])
        assert sent[:len(kinds[i::num_users])] == kinds[i::num_users]
        assert len(sent) == 2 * len(MIX)  # then it goes on drawing by weight
