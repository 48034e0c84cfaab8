"""The shipped dashboards against a real Prometheus (Debian's package, `make prometheus`) that scrapes a
real `fairlane serve --metrics-names vllm` with deploy/prometheus.yml.

Two tenants send interactive chat completions and batch-class completions in two waves, the second
after Prometheus has scraped the first, so that every rate() has an increase to see; one tenant
also runs a batch through the Batch API, and some requests are turned away. Then every PromQL
expression of deploy/grafana/fairlane-dashboard.json and of vLLM's own dashboard (the queries it
makes, in vllm_dashboard_queries.txt), Grafana variables filled in, must return data through
Prometheus's HTTP API.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.app.conftest import wait_for
from tests.app.served_process import ServedProcess
from tests.tenants_files import tenants_toml

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MODEL = "builtin:tiny"
ADMIN_KEY = "fl-admin-prometheus"
KEYS = {"alice": "fl-alice-prometheus", "bob": "fl-bob-prometheus"}
TENANTS_TOML = tenants_toml(KEYS, admin_key=ADMIN_KEY)
# Grafana's variables, as a dashboard opened on this server with "All" tenants and classes would fill them.
RATE_INTERVAL = "1m"  # covers the whole test at a 1 s scrape interval
VARIABLES = {"$__rate_interval": RATE_INTERVAL, "$__interval": "1s", "$interval": "1s",
             "$model_name": MODEL, "$tenant": ".*", "$class": ".*"}
PROMETHEUS_START_TRIES = 5


# ---- Prometheus ---------------------------------------------------------------------------------


def scrape_config(server_url: str, directory: Path) -> Path:
    """deploy/prometheus.yml aimed at the server, scraping every second, with the admin key beside it."""
    text = (DEPLOY / "prometheus.yml").read_text()
    for shipped, wanted in (('"127.0.0.1:8000"', f'"{server_url.removeprefix("http://")}"'),
                            ("scrape_interval: 15s", "scrape_interval: 1s")):
        assert shipped in text, f"deploy/prometheus.yml no longer holds {shipped}"
        text = text.replace(shipped, wanted)
    (directory / "fairlane-admin-key").write_text(ADMIN_KEY)
    config = directory / "prometheus.yml"
    config.write_text(text)
    return config


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Prometheus:
    process: subprocess.Popen[bytes]
    http: httpx.Client  # to its HTTP API

    @classmethod
    def start(cls, config: Path, directory: Path) -> Prometheus:
        """Prometheus cannot bind port 0: take a port the OS says is free, and try another if
        something took it before Prometheus bound it."""
        binary = shutil.which("prometheus")
        assert binary is not None, "Debian's prometheus is missing: run `make prometheus`"
        for attempt in range(PROMETHEUS_START_TRIES):
            started = cls._start_on_a_free_port(binary, config, directory / f"try-{attempt}")
            if started is not None:
                return started
        raise AssertionError(f"no free port for prometheus after {PROMETHEUS_START_TRIES} tries")

    @classmethod
    def _start_on_a_free_port(cls, binary: str, config: Path, directory: Path) -> Prometheus | None:
        """Started and ready, or None if the port was taken; fails on any other exit."""
        directory.mkdir()
        log = directory / "prometheus.log"
        address = f"127.0.0.1:{unused_port()}"
        with log.open("wb") as sink:
            process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={directory}",
                                        f"--web.listen-address={address}", "--log.level=warn"],
                                       stdout=subprocess.DEVNULL, stderr=sink)
        started = cls(process, httpx.Client(base_url=f"http://{address}", timeout=10))
        wait_for(lambda: started.is_ready() or process.poll() is not None, timeout=30, interval=0.05,
                 what="prometheus to start")
        if process.poll() is None:
            return started
        started.http.close()
        if "address already in use" not in log.read_text():
            raise AssertionError(f"prometheus exited: {log.read_text()}")
        return None

    def is_ready(self) -> bool:
        try:
            return self.http.get("/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.http.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = self.http.get("/api/v1/query", params={"query": expr})
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def total(self, expr: str) -> float:
        result = self.query(f"sum({expr})")
        return float(result[0]["value"][1]) if result else 0.0

    def label_values(self, label: str, match: str) -> list[str]:
        response = self.http.get(f"/api/v1/label/{label}/values", params={"match[]": match})
        values: list[str] = response.json()["data"]
        return values


# ---- the server and its traffic -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("prometheus-served")
    tenants = directory / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    env = {**os.environ, "FAIRLANE_TENANTS_FILE": str(tenants), "FAIRLANE_METRICS_NAMES": "vllm",
           "FAIRLANE_BATCH_DB_PATH": str(directory / "batches.db"), "FAIRLANE_BATCH_POLL_S": "0.1",
           "FAIRLANE_KV_CACHE_BYTES": str(4 * 1024 * 1024), "FAIRLANE_SHUTDOWN_GRACE_S": "1"}
    process = ServedProcess(env)
    try:
        yield process.wait_ready().base_url
    finally:
        process.kill()


@pytest.fixture(scope="module")
def prometheus(served: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    directory = tmp_path_factory.mktemp("prometheus")
    started = Prometheus.start(scrape_config(served, directory), directory)
    try:
        yield started
    finally:
        started.stop()


def client(base_url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def one_wave(base_url: str) -> int:
    """Each tenant: two interactive chat completions and two batch-class completions (the same
    prompts twice, for prefix-cache hits). Returns how many requests finished."""
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three rivers of Europe."}]
    for tenant in KEYS:
        tenant_client = client(base_url, tenant)
        for _ in range(2):
            tenant_client.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, temperature=0,
                                                  extra_body={"ignore_eos": True})
            tenant_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True, "service_tier": "flex"})
    return 4 * len(KEYS)


def turned_away(base_url: str) -> None:
    """A wrong key (401) and an unknown field (400)."""
    wrong = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                       headers={"authorization": "Bearer fl-guess"}, timeout=10)
    invalid = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "colour": "blue"},
                         headers={"authorization": f"Bearer {KEYS['bob']}"}, timeout=10)
    assert (wrong.status_code, invalid.status_code) == (401, 400)


def run_batch(base_url: str) -> int:
    """A two-item batch of alice's through the Batch API, to its end. Returns its item count."""
    lines = [{"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": f"Say {i}"}]}}
             for i in range(2)]
    alice = client(base_url, "alice")
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file_id = alice.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch").id
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: alice.batches.retrieve(batch.id).status == "completed", timeout=60, interval=0.1,
             what="the batch to complete")
    return len(lines)


def wait_until_scraped(prometheus: Prometheus, num_finished: int) -> None:
    wait_for(lambda: prometheus.total('fairlane:request_success_total{model_name="builtin:tiny"}') >= num_finished,
             timeout=30, interval=0.2, what=f"prometheus to have scraped {num_finished} finished requests")


@pytest.fixture(scope="module")
def scraped_traffic(served: str, prometheus: Prometheus) -> Prometheus:
    num_finished = one_wave(served) + run_batch(served)
    turned_away(served)
    wait_until_scraped(prometheus, num_finished)
    num_finished += one_wave(served)
    wait_until_scraped(prometheus, num_finished)
    return prometheus


# ---- the dashboards -----------------------------------------------------------------------------


def dashboard_queries(name: str) -> list[str]:
    """Every PromQL expression of a dashboard's panels, rows' panels included. vLLM's dashboard is
    not shipped: the queries it makes are listed in vllm_dashboard_queries.txt."""
    if name == "vllm-dashboard":
        lines = (Path(__file__).parent / "vllm_dashboard_queries.txt").read_text().splitlines()
        return [line for line in lines if line and not line.startswith("#")]
    dashboard = json.loads((DEPLOY / "grafana" / name).read_text())
    panels = [*dashboard["panels"], *(p for row in dashboard["panels"] for p in row.get("panels", []))]
    return [target["expr"] for panel in panels for target in panel.get("targets", []) if target.get("expr")]


def filled_in(expr: str) -> str:
    for variable in sorted(VARIABLES, key=len, reverse=True):  # $__rate_interval before $__interval
        expr = expr.replace(variable, VARIABLES[variable])
    assert not re.search(r"\$\w", expr), f"a Grafana variable left in {expr}"
    return expr


def has_data(result: list[dict[str, Any]]) -> bool:
    """Some series, and at least one of them a number (a panel of NaNs draws nothing)."""
    return any(not math.isnan(float(series["value"][1])) for series in result)


@pytest.mark.parametrize("dashboard", ["fairlane-dashboard.json", "vllm-dashboard"])
def test_every_dashboard_query_returns_data(scraped_traffic: Prometheus, dashboard: str) -> None:
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    empty = [expr for expr in map(filled_in, queries) if not has_data(scraped_traffic.query(expr))]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_dashboard_variables_find_the_model_and_tenants(scraped_traffic: Prometheus) -> None:
    # vLLM's model_name variable: label_values({__name__=~"vllm:.*"},model_name)
    assert scraped_traffic.label_values("model_name", '{__name__=~"vllm:.*"}') == [MODEL]
    assert scraped_traffic.label_values("model_name", "fairlane:num_requests_running") == [MODEL]
    assert scraped_traffic.label_values("tenant", f'fairlane:tenant_vtc_counter{{model_name="{MODEL}"}}') == [
        "alice", "bob"]


def test_traffic_is_seen_per_tenant_and_class(scraped_traffic: Prometheus) -> None:
    for tenant in KEYS:
        for class_name in ("interactive", "batch"):
            labels = f'model_name="{MODEL}",tenant="{tenant}",class="{class_name}",finished_reason="length"'
            assert scraped_traffic.total(f"fairlane:request_success_total{{{labels}}}") >= 4, (tenant, class_name)
    assert scraped_traffic.total('up{job="fairlane"}') == 1
    assert scraped_traffic.total('fairlane:batch_jobs{status="completed",tenant="alice"}') == 1
    assert scraped_traffic.total('fairlane:requests_rejected_total{reason="unauthorized"}') == 1
    assert scraped_traffic.total('fairlane:requests_rejected_total{reason="invalid_request",tenant="bob"}') == 1
