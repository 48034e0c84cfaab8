"""Disaggregated serving's settings: the two roles go together and need the prefix cache; a decode
replica gets a host tier to receive blocks into."""

from __future__ import annotations

import pytest

from config.settings import SettingsError, load_settings


@pytest.mark.parametrize(("overrides", "message"), [
    ({"prefill_replicas": 1}, "go together"),
    ({"decode_replicas": 2}, "go together"),
    ({"prefill_replicas": 1, "decode_replicas": 1, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ({"prefill_replicas": -1}, "prefill_replicas"),
    ({"torch_threads": 0}, "torch_threads"),
])
def test_bad_disaggregation_settings_name_what_is_wrong(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={}, overrides=overrides)


def test_a_cluster_with_roles_is_a_cluster_and_its_decode_replicas_get_a_host_tier() -> None:
    settings = load_settings(environ={}, overrides={"prefill_replicas": 1, "decode_replicas": 1})
    assert settings.is_disaggregated and settings.is_cluster
    assert settings.for_role("decode").kv_host_cache_bytes == settings.kv_handoff_host_cache_bytes
    assert settings.for_role("prefill").kv_host_cache_bytes == 0
    own = load_settings(environ={}, overrides={"prefill_replicas": 1, "decode_replicas": 1,
                                               "kv_host_cache_bytes": 1 << 20})
    assert own.for_role("decode").kv_host_cache_bytes == 1 << 20
    assert not load_settings(environ={}).is_cluster
