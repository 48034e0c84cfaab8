"""The data folders are created owner-only (0700) before anything writes there, whoever comes first."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from app.plumbing.private_dirs import prepare_data_dirs
from config.settings import Settings


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_data_folder_is_created_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = Settings(model_cache_dir=str(data / "models"), compile_cache_dir=str(data / "compile_cache"),
                        batch_db_path=str(data / "db" / "fairlane.db"), kv_disk_cache_path=str(data / "kv"),
                        kv_host_cache_bytes=1 << 20)
    previous = os.umask(0o022)  # the usual umask: a plain mkdir makes 0755
    try:
        prepare_data_dirs(settings)
    finally:
        os.umask(previous)
    for folder in (data, data / "models", data / "compile_cache", data / "db", data / "kv"):
        assert mode_of(folder) == 0o700, folder


def test_folders_that_exist_keep_their_owners_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    prepare_data_dirs(Settings(model_cache_dir=str(shared / "models"), compile_cache_dir=str(shared / "cc"),
                               batch_db_path=str(shared / "fairlane.db")))
    assert mode_of(shared) == 0o755
    assert mode_of(shared / "models") == 0o700
