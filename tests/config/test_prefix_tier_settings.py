"""The prefix cache tiers' settings and flags: sizes in bytes, a disk tier only above a host tier."""

from __future__ import annotations

import argparse

import pytest

from app.process.flags import add_model_flags, settings_from_args
from config.settings import SettingsError, load_settings


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    return parser.parse_args(list(argv))


def test_flags_make_the_tier_settings() -> None:
    settings = settings_from_args(flags("--kv-host-cache-bytes", "1000000", "--kv-disk-cache-path", "/var/kv",
                                        "--kv-disk-cache-bytes", "5000000"))
    assert (settings.kv_host_cache_bytes, settings.kv_disk_cache_path, settings.kv_disk_cache_bytes) == (
        1_000_000, "/var/kv", 5_000_000)
    default = settings_from_args(flags())
    assert default.kv_host_cache_bytes == 0 and default.kv_disk_cache_path is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kv_disk_cache_path": "/var/kv"}, "needs kv_host_cache_bytes"),
    ({"kv_host_cache_bytes": -1}, "kv_host_cache_bytes"),
    ({"cache_write_weight": 0.5}, "cache_write_weight"),
])
def test_bad_tier_settings_name_the_setting(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={}, overrides=overrides)
