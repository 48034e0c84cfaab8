"""The LoRA settings and flags: vLLM's names, `--lora-modules NAME=PATH` repeatable, `[[adapters]]` tables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from app.process.flags import add_model_flags, settings_from_args
from config.settings import AdapterEntry, SettingsError, load_settings


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    return parser.parse_args(list(argv))


def test_flags_make_the_lora_settings() -> None:
    settings = settings_from_args(flags("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                                        "--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"))
    assert settings.enable_lora and settings.max_loras == 2 and settings.max_lora_rank == 8
    assert settings.cpu_lora_capacity == 4  # 2 x max_loras when not given
    assert [(e.name, e.path, e.tenants) for e in settings.start_adapters()] == [
        ("a", "/x", None), ("b", "/y", None), ("c", "/z", None)]
    assert not settings_from_args(flags()).enable_lora


def test_adapters_tables_in_the_settings_file(tmp_path: Path) -> None:
    config = tmp_path / "fairlane.toml"
    config.write_text('enable_lora = true\nlora_modules = ["a=/x"]\n'
                      '[[adapters]]\nname = "b"\npath = "/y"\ntenants = ["acme"]\n')
    settings = load_settings(config, environ={})
    assert settings.start_adapters() == (AdapterEntry(name="a", path="/x"),
                                         AdapterEntry(name="b", path="/y", tenants=("acme",)))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"lora_modules": ("a=/x",)}, "need enable_lora"),
    ({"enable_lora": True, "lora_modules": ("nopath",)}, "must be NAME=PATH"),
    ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras must be >= max_loras"),
    ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank"),
])
def test_bad_lora_settings_name_the_setting(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={}, overrides=overrides)
