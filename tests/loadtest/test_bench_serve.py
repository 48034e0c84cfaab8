"""`fairlane bench serve` against a real builtin:tiny server on loopback: each level runs exactly its
requests, its report adds up, remote URLs are refused, and saved reports compare side by side."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import main
from gpu.models import LoadedModel
from loadtest.bench_serve import compare_table, default_requests, make_prompts
from tests.app.conftest import ServerThread, tiny_context

REQUESTS, MAX_TOKENS, WARMUP = 3, 8, 1
SECRET = "fl-not-in-the-report"


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    # Coalescing off: one SSE event per token, so every request has gaps to measure ITL with.
    started = ServerThread(tiny_context(tiny_model, stream_coalesce=False)).start()
    yield started
    started.stop()


def test_each_level_runs_exactly_its_requests_and_the_report_adds_up(
        server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    finished_before = server.stats()["requests_finished"]
    code = main(["bench", "serve", "--url", server.base_url, "--concurrency", "1,2", "--requests-per-level",
                 str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--prompt-tokens", "16", "--warmup", str(WARMUP),
                 "--label", "tiny", "--api-key", SECRET, "--out", str(out)])

    assert code == 0
    assert "tok/s" in capsys.readouterr().out
    assert SECRET not in out.read_text()
    report = json.loads(out.read_text())
    assert (report["label"], report["url"], report["model"]) == ("tiny", server.base_url, server.model_name)
    assert report["config"]["requests_per_level"] == [REQUESTS, REQUESTS] and not report["cut_short"]
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        check_level(level)
    # Warmups and measured requests, each sent once: nothing retried, nothing left over.
    assert server.stats()["requests_finished"] - finished_before == 2 * (WARMUP + REQUESTS)


def test_extra_body_fields_reach_every_request(server: ServerThread, tmp_path: Path) -> None:
    before = len(server.engine.submitted)
    code = main(["bench", "serve", "--url", server.base_url, "--concurrency", "2", "--requests-per-level", "2",
                 "--max-tokens", "3", "--prompt-tokens", "8", "--warmup", "0", "--out", str(tmp_path / "x.json"),
                 "--extra-body", '{"logprobs": true, "top_logprobs": 2, "presence_penalty": 0.5}'])

    sent = server.engine.submitted[before:]
    assert code == 0 and len(sent) == 2
    assert all(r.sampling.logprobs == 2 and r.sampling.presence_penalty == 0.5 for r in sent)


def check_level(level: dict[str, Any]) -> None:
    assert (level["requests"], level["num_errors"], level["errors"]) == (REQUESTS, 0, {})
    assert level["completion_tokens"] == REQUESTS * MAX_TOKENS  # ignore_eos: every request runs to max_tokens
    assert level["output_tokens_per_s"] > 0 and level["wall_s"] > 0
    for metric in ("ttft", "itl"):
        assert 0 < level[f"{metric}_p50_ms"] <= level[f"{metric}_p99_ms"]
    assert level["ttft_p50_ms"] <= level["e2e_p50_ms"] <= 1000 * level["wall_s"]
    assert len(level["loadavg_start"]) == len(level["loadavg_end"]) == 3


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A loopback port that completes TCP handshakes (the backlog) but never answers a request."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_silent_server_times_requests_out_and_the_run_is_cut_short(silent_url: str, tmp_path: Path) -> None:
    out = tmp_path / "silent.json"
    # Ten levels of one request that each take the 0.2 s request timeout cannot fit in 0.5 s.
    code = main(["bench", "serve", "--url", silent_url, "--model", "m", "--concurrency", ",".join(["1"] * 10),
                 "--requests-per-level", "1", "--warmup", "0", "--request-timeout", "0.2", "--max-run-s", "0.5",
                 "--out", str(out)])

    report = json.loads(out.read_text())
    assert code == 1 and report["cut_short"] and len(report["levels"]) < 10
    assert all(lv["errors"] == {"timeout": 1} and lv["completion_tokens"] == 0 for lv in report["levels"])


@pytest.mark.parametrize("flags", [["--url", "http://10.0.0.1:8000"], ["--url", "https://example.com"]])
def test_remote_urls_are_refused_unless_allowed(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", *flags]) == 2
    assert "--allow-remote" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--concurrency", "0"], ["--concurrency", "1,x"], ["--requests-per-level", "0"],
                                   ["--request-timeout", "7200"], ["--extra-body", "[1]"], ["--extra-body", "{x"]])
def test_runs_outside_the_caps_are_refused_before_sending(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *flags]) == 2  # nothing listens there
    assert "error:" in capsys.readouterr().err


def test_prompts_are_seeded_distinct_and_about_the_asked_length() -> None:
    prompts = make_prompts(seed=0, prompt_tokens=200, count=20)
    assert prompts == make_prompts(seed=0, prompt_tokens=200, count=20)
    assert prompts != make_prompts(seed=1, prompt_tokens=200, count=20)
    assert len({p.split()[1] for p in prompts}) > 1 and len(set(prompts)) == 20
    assert all(abs(len(p.split()) - 151) <= 1 for p in prompts)  # 150 words and the leading number
    assert [default_requests(c) for c in (1, 8, 64, 1024)] == [8, 16, 128, 256]


def level(concurrency: int, tokens_per_s: float, itl_ms: float | None, ttft_ms: float) -> dict[str, Any]:
    return {"concurrency": concurrency, "output_tokens_per_s": tokens_per_s, "itl_p50_ms": itl_ms,
            "ttft_p50_ms": ttft_ms}


def test_compare_table_shows_each_label_per_level_with_ratios_to_the_first() -> None:
    fairlane = {"label": "fairlane", "levels": [level(1, 100.0, 10.0, 50.0), level(8, 400.0, 20.0, 80.0)]}
    llama = {"label": "llama.cpp", "levels": [level(1, 200.0, 5.0, 25.0), level(8, 300.0, None, 120.0),
                                              level(32, 500.0, 60.0, 300.0)]}

    lines = compare_table([fairlane, llama]).splitlines()

    assert lines[0].split() == ["concurrency", "label", "tok/s", "vs", "first", "ITL", "p50", "ms", "vs", "first",
                                "TTFT", "p50", "ms", "vs", "first"]
    rows = [line.split() for line in lines[2:]]
    assert rows == [
        ["1", "fairlane", "100.00", "1.00x", "10.00", "1.00x", "50.00", "1.00x"],
        ["1", "llama.cpp", "200.00", "2.00x", "5.00", "0.50x", "25.00", "0.50x"],
        ["8", "fairlane", "400.00", "1.00x", "20.00", "1.00x", "80.00", "1.00x"],
        ["8", "llama.cpp", "300.00", "0.75x", "-", "-", "120.00", "1.50x"],
        ["32", "fairlane", "-", "-", "-", "-", "-", "-"],  # a level only the second run has: no base to divide by
        ["32", "llama.cpp", "500.00", "-", "60.00", "-", "300.00", "-"],
    ]


def test_compare_reads_saved_reports_and_refuses_other_json(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "a.json", tmp_path / "b.json"
    good.write_text(json.dumps({"label": "a", "levels": [level(1, 10.0, 1.0, 2.0)]}))
    bad.write_text(json.dumps({"systems": {}}))
    assert main(["bench", "serve", "--compare", str(good), str(good)]) == 0
    assert "1.00x" in capsys.readouterr().out
    assert main(["bench", "serve", "--compare", str(good), str(bad)]) == 2
    assert "not a `fairlane bench serve` report" in capsys.readouterr().err
