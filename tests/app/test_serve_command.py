"""`fairlane serve` reads its settings like every command: a bad one stops it before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.process.cli import build_parser, main
from app.process.engine_factory import scheduler_config_of


def test_an_unknown_config_key_is_named_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fairlane.toml"
    config.write_text('model = "builtin:tiny"\nmax_tokens_per_dream = 3\n')

    assert main(["serve", "--config", str(config)]) == 2
    assert "unknown setting 'max_tokens_per_dream'" in capsys.readouterr().err


def test_serve_flags_reach_the_settings() -> None:
    from app.process.flags import settings_from_args
    from app.process.server import SERVE_FLAG_KEYS

    args = build_parser().parse_args(["serve", "--model", "builtin:tiny", "--port", "0", "--max-num-seqs", "8",
                                      "--shutdown-grace-s", "1.5", "--default-max-tokens", "32",
                                      "--metrics-names", "vllm", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces",
                                      "--max-queued-requests", "32", "--batch-queue-fraction", "0.5",
                                      "--queue-order", "hrrn", "--long-prefill-token-threshold", "512"])
    settings = settings_from_args(args, SERVE_FLAG_KEYS)

    assert (settings.model, settings.port, settings.max_num_seqs) == ("builtin:tiny", 0, 8)
    assert (settings.shutdown_grace_s, settings.default_max_tokens) == (1.5, 32)
    assert (settings.metrics_names, settings.otlp_traces_endpoint) == ("vllm", "http://127.0.0.1:4318/v1/traces")
    assert (settings.max_queued_requests, settings.batch_queue_fraction) == (32, 0.5)
    assert settings.queue_order == "hrrn"
    assert settings.long_prefill_token_threshold == 512
    assert scheduler_config_of(settings).long_prefill_token_threshold == 512


def test_a_malformed_tenants_file_is_named_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nid = "acme"\nweight = 1\n\n[[tenants]]\nid = "beta"\nweight = -2\n')

    assert main(["serve", "--model", "builtin:tiny", "--port", "0", "--tenants", str(tenants)]) == 2
    error = capsys.readouterr().err
    assert "tenants[1] (id 'beta')" in error and "'weight'" in error


def test_serving_without_a_tenants_file_warns(caplog: pytest.LogCaptureFixture) -> None:
    from app.process.server import warn_if_unauthenticated
    from config.settings import load_settings

    with caplog.at_level("WARNING", logger="app.process.server"):
        warn_if_unauthenticated(load_settings(environ={}, overrides={"tenants_file": "tenants.toml"}))
        assert not caplog.records
        warn_if_unauthenticated(load_settings(environ={}))
    assert "without authentication" in caplog.records[0].getMessage()
