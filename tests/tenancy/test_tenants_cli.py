"""`fairlane tenants add`, through the command's own entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.process.cli import main
from tenancy.tenants import hash_api_key, load_tenants


def test_tenants_add_prints_the_key_once_and_stores_its_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    path = tmp_path / "tenants.toml"
    assert main(["tenants", "add", "alice", "--weight", "2", "--file", str(path)]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("fl-") and "\n" not in key
    assert "alice" in err and "only this once" in err and key not in err
    text = path.read_text(encoding="utf-8")
    assert key not in text and hash_api_key(key) in text
    tenant = load_tenants(path).authenticate(key)
    assert tenant is not None and tenant.tenant_id == "alice" and tenant.weight == 2.0


def test_tenants_add_defaults_to_tenants_toml_here_and_weight_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["tenants", "add", "bob"]) == 0
    assert main(["tenants", "add", "carol", "--weight", "0.5"]) == 0
    first, second = capsys.readouterr().out.split()
    registry = load_tenants(tmp_path / "tenants.toml")
    bob, carol = registry.authenticate(first), registry.authenticate(second)
    assert bob is not None and bob.tenant_id == "bob" and bob.weight == 1.0
    assert carol is not None and carol.tenant_id == "carol" and carol.weight == 0.5


@pytest.mark.parametrize(("argv", "message"), [
    (["tenants", "add", "alice"], "tenant 'alice' already exists"),
    (["tenants", "add", "bob", "--weight", "0"], "weight must be a finite number > 0"),
    (["tenants", "add", "b\"ob"], "must be 1-64 letters, digits"),
])
def test_tenants_add_refuses_and_leaves_the_file_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       argv: list[str], message: str) -> None:
    path = tmp_path / "tenants.toml"
    assert main(["tenants", "add", "alice", "--file", str(path)]) == 0
    before = path.read_text(encoding="utf-8")
    capsys.readouterr()
    assert main([*argv, "--file", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err
    assert path.read_text(encoding="utf-8") == before


def test_tenants_needs_an_action(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["tenants"])
    assert exited.value.code == 2
    assert "tenants" in capsys.readouterr().err


def test_tenants_admin_key_adds_the_operator_key_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tenants.toml"
    assert main(["tenants", "add", "alice", "--file", str(path)]) == 0
    tenant_key = capsys.readouterr().out.strip()
    assert main(["tenants", "admin-key", "--file", str(path)]) == 0
    admin_key = capsys.readouterr().out.strip()
    registry = load_tenants(path)

    assert registry.is_admin(admin_key) and not registry.is_admin(tenant_key)
    assert admin_key not in path.read_text(encoding="utf-8")
    assert main(["tenants", "admin-key", "--file", str(path)]) == 2  # one [admin] table per file
    assert "already has an [admin] table" in capsys.readouterr().err
