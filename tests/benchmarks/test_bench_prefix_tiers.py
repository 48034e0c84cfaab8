"""`fairlane bench prefix --tiers` end to end on builtin:tiny: a few tenants, two configurations."""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks.cli import main


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "tiers.json"
    code = main(["bench", "prefix", "--tiers", "--model", "builtin:tiny", "--tenants", "4", "--system-tokens", "64",
                 "--rounds", "1", "--max-tokens", "2", "--configs", "device,device+host+disk",
                 "--disk-dir", str(folder), "--out", str(out)])
    assert code == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_only_the_configurations_asked_for_run(report: dict[str, Any]) -> None:
    assert list(report["configurations"]) == ["device", "device+host+disk"]
    assert set(report["ratios"]) == {"disk TTFT p50 vs device only", "restart first TTFT p50 vs cold"}


def test_the_tiers_serve_prefixes_the_device_pool_has_evicted(report: dict[str, Any]) -> None:
    device, tiered = (report["configurations"][m]["warm"] for m in ("device", "device+host+disk"))
    assert device["requests"] == tiered["requests"] == 4
    assert tiered["hit_rate"] > device["hit_rate"]
    disk = tiered["tiers"]["disk"]
    assert disk["writes"] > 0 and disk["lost"] == 0


def test_a_restart_finds_the_prefixes_on_disk(report: dict[str, Any]) -> None:
    assert report["restart"]["requests"] == 4
    assert report["restart"]["hit_rate"] > 0


def test_an_unknown_configuration_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "prefix", "--tiers", "--configs", "device,gpu"])
    assert "configurations are some of" in capsys.readouterr().err
