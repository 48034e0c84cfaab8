"""`python -m loadtest` against a real builtin:tiny server with two tenants: each scenario runs briefly,
its report adds up and agrees with the server's own counters, and the leak check can fail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu.models import LoadedModel
from loadtest.__main__ import main
from loadtest.client import is_loopback_url, settle
from loadtest.scenarios import SCENARIOS, RunConfig, split_rate
from loadtest.stats import jain_index, percentile
from loadtest.tenants import main as tenants_main
from loadtest.workload import LoadTenant, LoadTenantsError, load_tenants
from tenancy.tenants import load_tenants as load_server_tenants
from tests.app.conftest import ServerThread, tiny_context

MiB = 1024 * 1024
ADMIN_KEY = "fl-operator-load"
CLIENT_TENANTS = f"""
[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
id = "alice"
api_key = "fl-alice-load"
weight = 2

[[tenants]]
id = "bob"
api_key = "fl-bob-load"
"""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BRIEF_RUN = ["--duration", "1.5", "--rate", "6", "--max-requests", "12", "--backlog", "2", "--batch-items", "4",
             "--seed", "1", "--drain-timeout", "20", "--settle-timeout", "10"]


@pytest.fixture(scope="module")
def tenant_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("loadtest-tenants")
    client_file, server_file = folder / "client.toml", folder / "server.toml"
    client_file.write_text(CLIENT_TENANTS)
    assert tenants_main([str(client_file), str(server_file)]) == 0
    return client_file, server_file


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel, tenant_files: tuple[Path, Path]) -> Iterator[ServerThread]:
    # 512 blocks of 16 tokens: room for the shared-prefix scenario's system prompt (byte tokens) many times over.
    context = tiny_context(tiny_model, tenants_file=str(tenant_files[1]), kv_cache_bytes=16 * MiB,
                           swap_space_bytes=8 * MiB, batch_poll_s=0.1)
    started = ServerThread(context).start()
    yield started
    started.stop()


def run_cli(scenario: str, server: ServerThread, client_file: Path, out: Path) -> tuple[int, dict[str, Any]]:
    code = main([scenario, "--url", server.base_url, "--tenants", str(client_file), "--out", str(out), *BRIEF_RUN])
    return code, json.loads((out / "report.json").read_text())


def check_adds_up(report: dict[str, Any]) -> None:
    totals = report["totals"]
    assert totals["sent"] == len(report["requests"]) > 0
    groups = [totals, *report["by_class"].values(), *report["by_tenant"].values(), *report["by_tenant_class"]]
    for group in groups:
        assert group["ok"] + group["dropped"] + group["num_errors"] == group["sent"]
        assert group["num_errors"] == sum(group["errors"].values())
        for metric in ("ttft_s", "itl_s", "e2e_s"):
            p50, p90, p99 = (group[metric][f"p{p}"] for p in (50, 90, 99))
            assert (p50 is None and p99 is None) or 0 <= p50 <= p90 <= p99
    for split in ("by_class", "by_tenant"):
        assert sum(g["sent"] for g in report[split].values()) == totals["sent"]
        assert sum(g["output_tokens"] for g in report[split].values()) == totals["output_tokens"]
    assert sum(g["sent"] for g in report["by_tenant_class"]) == totals["sent"]
    assert totals["requests_per_s"] > 0 and totals["output_tokens_per_s"] > 0
    assert totals["errors"] == {}  # a healthy server under a light load refuses nothing


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_runs_and_its_report_adds_up(scenario: str, server: ServerThread, tenant_files: tuple[Path, Path],
                                              tmp_path: Path) -> None:
    code, report = run_cli(scenario, server, tenant_files[0], tmp_path)

    assert code == 0 and report["passed"] and report["failures"] == []
    stats = report["leak_check"]["stats"]
    assert stats["kv_blocks_in_use"] == stats["running"] == stats["waiting"] == stats["swapped"] == 0
    check_adds_up(report)
    delta, totals = report["server_delta"], report["totals"]
    # Every request the client sent ended on the server, one way or the other.
    assert delta["requests_finished"] + delta["requests_aborted"] == totals["sent"]
    assert set(report["by_tenant"]) <= {"alice", "bob"} and report["jain_index"] is not None
    assert "**Leak check: passed**" in (tmp_path / "summary.md").read_text()
    for plot in ("latency_cdf.png", "tenant_throughput.png"):
        assert (tmp_path / plot).read_bytes().startswith(PNG_MAGIC)
    check_scenario(scenario, report)


def check_scenario(scenario: str, report: dict[str, Any]) -> None:
    by_class, by_tenant, totals = report["by_class"], report["by_tenant"], report["totals"]
    if scenario == "flood":
        assert set(by_class) == {"batch", "interactive"}
    elif scenario == "skew":
        assert by_tenant["alice"]["sent"] > by_tenant.get("bob", {"sent": 0})["sent"]
    elif scenario == "shared-prefix":
        assert 0 < totals["cached_tokens"] < totals["prompt_tokens"]
        assert report["server_delta"]["prefix_cache_hit_tokens"] == totals["cached_tokens"]
    elif scenario == "disconnect":
        assert totals["dropped"] > 0 and totals["ok"] > 0
    elif scenario == "batch-api":
        assert by_class["batch-api"]["sent"] == by_class["batch-api"]["ok"] == 4
        assert [b["status"] for b in report["batches"]] == ["completed", "completed"]
        assert by_class["batch-api"]["output_tokens"] > 0
    else:
        assert set(by_class) == {"interactive"}


async def test_leak_check_fails_while_a_request_is_still_running(server: ServerThread) -> None:
    body = {"model": server.model_name, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"authorization": "Bearer fl-bob-load"}) as response:
            assert response.status_code == 200
            chunks = response.aiter_bytes()  # held: a dropped iterator would be closed, and the request with it
            assert await anext(chunks)  # the request is running now
            busy = await settle(http, timeout_s=0.3, admin_key=ADMIN_KEY)
        idle = await settle(http, timeout_s=10, admin_key=ADMIN_KEY)

    assert not busy.passed and len(busy.problems) == 1 and "1 request(s) still running (stuck)" in busy.problems[0]
    assert busy.stats["kv_blocks_in_use"] > 0
    assert idle.passed and idle.problems == []


async def test_leak_check_names_leaked_blocks_on_an_idle_server() -> None:
    stats = {"running": 0, "waiting": 0, "swapped": 0, "kv_blocks_in_use": 3, "kv_blocks_total": 64,
             "cpu_blocks_in_use": 0}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=stats))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1") as http:
        result = await settle(http, timeout_s=0.05, interval_s=0.01)
    assert not result.passed
    assert len(result.problems) == 1 and "3 of 64 KV blocks still in use (leaked)" in result.problems[0]


def test_remote_urls_are_refused_unless_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    assert all(is_loopback_url(url) for url in ("http://127.0.0.1:8000", "http://localhost", "http://[::1]:80",
                                                "http://127.0.0.2"))
    assert not any(is_loopback_url(url) for url in ("http://10.0.0.1:8000", "https://example.com", "http://0.0.0.0"))
    assert main(["chat", "--url", "http://10.0.0.1:8000"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["skew"], ["chat", "--duration", "601"], ["chat", "--max-requests", "0"],
                                   ["chat", "--rate", "0"]])
def test_runs_outside_the_caps_are_refused_before_sending(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*flags, "--url", "http://127.0.0.1:9"]) == 2  # nothing listens there: no request is attempted
    assert "error:" in capsys.readouterr().err


def test_tenants_files_agree_on_ids_weights_and_keys(tenant_files: tuple[Path, Path], tmp_path: Path) -> None:
    client = load_tenants(tenant_files[0])
    registry = load_server_tenants(tenant_files[1])
    for tenant in client:
        found = registry.authenticate(tenant.api_key)
        assert found is not None and (found.tenant_id, found.weight) == (tenant.tenant_id, tenant.weight)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenants]]\nid = "x"\napi_key = "k"\nweight = 0\n')
    with pytest.raises(LoadTenantsError, match=r"tenants\[0\] \(id 'x'\): 'weight' must be a finite number > 0"):
        load_tenants(bad)  # the server's parser read it: its message, word for word


def test_the_load_tool_reads_every_field_the_server_does(tmp_path: Path) -> None:
    """One parser: a field of the server's tenants file is taken, a field it does not know is refused."""
    good = tmp_path / "good.toml"
    good.write_text('[[tenants]]\nid = "x"\napi_key = "k"\nclasses = ["batch"]\nmax_concurrent = 2\n')
    assert load_tenants(good)[0].tenant_id == "x"
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenants]]\nid = "x"\napi_key = "k"\nclasses = ["bulk"]\n')
    with pytest.raises(LoadTenantsError, match=r"'classes' must be a non-empty list"):
        load_tenants(bad)
    hashed = tmp_path / "hashed.toml"
    hashed.write_text('[[tenants]]\nid = "x"\napi_key_hashes = []\n')
    with pytest.raises(LoadTenantsError, match=r"needs each key in the clear"):
        load_tenants(hashed)


def test_skew_gives_the_first_tenant_ten_times_each_other_ones_rate() -> None:
    tenants = (LoadTenant("heavy", "k1"), LoadTenant("light-1", "k2"), LoadTenant("light-2", "k3"))
    config = RunConfig("skew", "http://127.0.0.1:1", rate=12.0, tenants=tenants)
    rates = dict((tenant.tenant_id, rate) for tenant, rate in split_rate(config, [10.0, 1.0, 1.0]))
    assert rates == pytest.approx({"heavy": 10.0, "light-1": 1.0, "light-2": 1.0})


def test_percentiles_interpolate_and_jain_spans_one_over_n_to_one() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0], 99) == 1.0
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0]) is None
