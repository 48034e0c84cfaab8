"""The dashboard: its snapshots, its event stream, and the page in a real headless Chromium."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from app.observability.dashboard import DashboardFeed
from app.observability.routes import Observability
from benchmarks.fake_executors import FakeExecutor
from scheduling.engine import Engine
from scheduling.request import PriorityClass
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry
from tests.app.conftest import ServerThread
from tests.conftest import REPO_ROOT
from tests.factories import collect, make_geometry, make_request, running

CHROMIUM = "/usr/bin/chromium"  # Debian's package, installed by `make install`
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = REPO_ROOT / "test-artifacts" / "dashboard.png"
TWO_TENANTS = TenantRegistry([Tenant(TenantId("alice")), Tenant(TenantId("bob"))], requires_auth=True)


def observed_engine() -> tuple[Engine, DashboardFeed]:
    executor = FakeExecutor(make_geometry(num_device_blocks=64, block_size=4))
    engine = Engine(Scheduler(SchedulerConfig(), executor.geometry, TWO_TENANTS), executor)
    return engine, Observability.attach(engine).dashboard


async def test_snapshot_rates_per_tenant_since_the_previous_one() -> None:
    engine, feed = observed_engine()
    first, totals = feed.snapshot(None, now=100.0)
    async with running(engine):
        for tenant, max_tokens in [("alice", 6), ("bob", 2)]:
            await collect(engine.submit(make_request(10, max_tokens, tenant_id=tenant,
                                                     priority=PriorityClass.BATCH)))
    second, _ = feed.snapshot(totals, now=102.0)

    assert [t["generation_tokens_per_s"] for t in first["tenants"]] == [0, 0]
    rates = {t["tenant"]: (t["generation_tokens_per_s"], t["prompt_tokens_per_s"]) for t in second["tenants"]}
    assert rates == {"alice": (3.0, 5.0), "bob": (1.0, 5.0)}  # tokens over the 2 s between snapshots
    assert second["interval_s"] == 2.0
    assert second["classes"]["batch"] == {"running": 0, "waiting": 0, "swapped": 0}
    assert second["preemptions"] == {"swap": {"total": 0, "new": 0}, "recompute": {"total": 0, "new": 0}}
    assert all(t["vtc"]["batch"] > 0 and t["vtc"]["interactive"] == 0 for t in second["tenants"])


async def test_event_stream_ends_when_the_server_drains() -> None:
    executor = FakeExecutor(make_geometry())
    engine = Engine(Scheduler(SchedulerConfig(), executor.geometry), executor)
    draining = threading.Event()
    feed = Observability.attach(engine, is_draining=draining.is_set, dashboard_interval_s=0.01).dashboard
    events = feed.events()

    assert (await anext(events)).startswith(b"retry: ")
    first = await anext(events)
    assert first.startswith(b"data: ") and first.endswith(b"\n\n")
    assert orjson.loads(first.removeprefix(b"data: "))["kv_cache_usage"] == 0
    draining.set()
    with pytest.raises(StopAsyncIteration):
        await anext(events)


# ---- in a browser -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Load:
    """Keeps an interactive and a batch client generating until stopped."""

    def __init__(self, server: ServerThread) -> None:
        self._server = server
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(tier,), daemon=True) for tier in ("auto", "flex")]
        self.errors: list[str] = []

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        assert not self.errors, self.errors

    def _run(self, tier: str) -> None:
        body = {"model": self._server.model_name, "prompt": f"A story for the {tier} tier:", "max_tokens": 32,
                "ignore_eos": True, "service_tier": tier}
        with httpx.Client(base_url=self._server.base_url, timeout=60) as client:
            while not self._stop.is_set():
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    self.errors.append(response.text)
                    return


# Distinct rows of the canvas holding coloured pixels: the series' lines (axes and labels are grey).
SERIES_ROWS_JS = """(id) => {
  const canvas = document.getElementById(id);
  const { width, height } = canvas;
  const data = canvas.getContext("2d").getImageData(0, 0, width, height).data;
  const rows = new Set();
  for (let i = 0; i < data.length; i += 4) {
    const spread = Math.max(data[i], data[i + 1], data[i + 2]) - Math.min(data[i], data[i + 1], data[i + 2]);
    if (spread > 80 && data[i + 3] > 200) rows.add(Math.floor(i / 4 / width));
  }
  return rows.size;
}"""
# Data has arrived and reached the charts: snapshots counted, a token rate above zero in the tenant
# table, and the token chart has drawn points.
RECEIVED_DATA_JS = """() => Number(document.body.dataset.snapshots) >= 3
  && Number(document.getElementById("chart-tokens").dataset.points) >= 3
  && [...document.querySelectorAll("#tenant-rows tr")].some((row) => Number(row.cells[1].textContent) > 0)"""
CHARTS = ("chart-tokens", "chart-queues", "chart-memory", "chart-preemptions")


def open_dashboard(browser: Browser, server: ServerThread) -> Page:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    console_errors: list[str] = []
    page.on("console", lambda message: console_errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: console_errors.append(str(error)))
    page.goto(f"{server.base_url}/dashboard")
    page.wait_for_function(RECEIVED_DATA_JS, timeout=20_000)
    assert not console_errors, console_errors
    return page


def test_dashboard_draws_live_data(browser: Browser, start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    with Load(server):
        page = open_dashboard(browser, server)
        try:
            assert page.inner_text("#status") == "live"
            assert page.inner_text("#tenant-rows tr td:first-child") == "default"
            for chart in CHARTS:
                assert int(page.get_attribute(f"#{chart}", "data-points") or 0) >= 3, chart
                assert page.evaluate(SERIES_ROWS_JS, chart) > 0, f"{chart} drew no series"
            # A rate that went from zero to above it is a line across several rows, not a flat one.
            assert page.evaluate(SERIES_ROWS_JS, "chart-tokens") > 3
            Path(SCREENSHOT).parent.mkdir(exist_ok=True)
            page.screenshot(path=SCREENSHOT, full_page=True)
        finally:
            page.close()
