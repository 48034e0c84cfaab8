"""load_settings: defaults < TOML < FAIRLANE_* environment < overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from config.settings import Settings, SettingsError, SpeculativeConfig, load_settings


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fairlane.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_any_source() -> None:
    assert load_settings(environ={}) == Settings()


def test_each_source_overrides_the_one_below(tmp_path: Path) -> None:
    config = write_toml(tmp_path, 'model = "builtin:small"\nport = 9000\nblock_size = 32\nmax_num_seqs = 8\n')
    environ = {"FAIRLANE_PORT": "9001", "FAIRLANE_BLOCK_SIZE": "8", "UNRELATED": "x"}
    settings = load_settings(config, environ=environ, overrides={"block_size": 4})
    assert settings.model == "builtin:small"  # TOML only
    assert settings.max_num_seqs == 8  # TOML only
    assert settings.port == 9001  # environment over TOML
    assert settings.block_size == 4  # override over environment and TOML
    assert settings.host == Settings().host  # nobody set it: the default


def test_an_override_of_none_leaves_the_lower_source(tmp_path: Path) -> None:
    settings = load_settings(environ={"FAIRLANE_PORT": "9001"}, overrides={"port": None, "model": None})
    assert settings.port == 9001
    assert settings.model == Settings().model


def test_process_environment_is_read_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIRLANE_MAX_NUM_SEQS", "3")
    assert load_settings().max_num_seqs == 3


def test_environment_none_means_unset_optional() -> None:
    settings = load_settings(environ={"FAIRLANE_MAX_MODEL_LEN": "none", "FAIRLANE_SERVED_MODEL_NAME": "null"})
    assert settings.max_model_len is None and settings.served_model_name is None


def test_unknown_toml_key_is_named(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "port = 9000\nmax_batch_tokens = 64\n")
    with pytest.raises(SettingsError, match="unknown setting 'max_batch_tokens'"):
        load_settings(config, environ={})


def test_unknown_environment_key_is_named() -> None:
    with pytest.raises(SettingsError, match="unknown setting 'kv_cache_size'"):
        load_settings(environ={"FAIRLANE_KV_CACHE_SIZE": "1000"})


def test_unknown_override_is_named() -> None:
    with pytest.raises(SettingsError, match="unknown setting 'colour'"):
        load_settings(environ={}, overrides={"colour": "blue"})


@pytest.mark.parametrize(("environ", "key"), [
    ({"FAIRLANE_PORT": "eighty"}, "port"),
    ({"FAIRLANE_PORT": "70000"}, "port"),
    ({"FAIRLANE_BLOCK_SIZE": "0"}, "block_size"),
    ({"FAIRLANE_DEVICE": "tpu"}, "device"),
    ({"FAIRLANE_METRICS_NAMES": "tgi"}, "metrics_names"),
    ({"FAIRLANE_OTLP_TRACES_ENDPOINT": "127.0.0.1:4318"}, "otlp_traces_endpoint"),  # no scheme
    ({"FAIRLANE_BATCH_QUEUE_FRACTION": "0"}, "batch_queue_fraction"),
    ({"FAIRLANE_BATCH_QUEUE_FRACTION": "1.5"}, "batch_queue_fraction"),
])
def test_invalid_environment_value_is_named(environ: dict[str, str], key: str) -> None:
    with pytest.raises(SettingsError, match=f"setting '{key}'"):
        load_settings(environ=environ)


def test_invalid_toml_value_is_named(tmp_path: Path) -> None:
    config = write_toml(tmp_path, 'max_num_seqs = "many"\n')
    with pytest.raises(SettingsError, match="setting 'max_num_seqs'"):
        load_settings(config, environ={})


def test_budget_smaller_than_the_sequence_cap_is_refused() -> None:
    with pytest.raises(SettingsError, match="max_num_batched_tokens must be >= max_num_seqs"):
        load_settings(environ={}, overrides={"max_num_seqs": 64, "max_num_batched_tokens": 32})


def test_missing_or_malformed_file_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "absent.toml", environ={})
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(write_toml(tmp_path, "port = = 1\n"), environ={})


def test_settings_are_frozen() -> None:
    settings = load_settings(environ={})
    with pytest.raises(pydantic.ValidationError):
        settings.port = 1  # type: ignore[misc]


def test_speculative_config_takes_vllms_json_and_none_turns_it_off(tmp_path: Path) -> None:
    assert load_settings(environ={}).speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=8)
    flag = load_settings(environ={}, overrides={"speculative_config": '{"method": "suffix", "prompt_lookup_max": 3}'})
    assert flag.speculative_config == SpeculativeConfig(method="suffix", prompt_lookup_max=3)
    assert load_settings(environ={"FAIRLANE_SPECULATIVE_CONFIG": "none"}).speculative_config is None
    assert load_settings(environ={}, overrides={"speculative_config": "off"}).speculative_config is None
    toml = tmp_path / "fairlane.toml"
    toml.write_text('[speculative_config]\nmethod = "ngram"\nnum_speculative_tokens = 3\n')
    assert load_settings(toml, environ={}).speculative_config == SpeculativeConfig(method="ngram",
                                                                                   num_speculative_tokens=3)


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "draft_model"}', "needs it"),
    ('{"method": "ngram", "model": "builtin:tiny"}', "only it takes it"),
    ('{"method": "eagle3"}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram"', "not valid JSON"),
])
def test_a_bad_speculative_config_names_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={}, overrides={"speculative_config": value})
