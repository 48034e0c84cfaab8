"""The server's data folders, readable by their owner only, whoever creates them first.

The model cache, the compile cache, the Batch API's database and the KV disk tier all live under `./data`
by default. Each used to create its folders itself, so the first to run (the model cache, at start-up)
made `./data` with the umask's 0755 and the database's 0700 came too late for its parent. The server now
creates every one of them 0700 before anything else writes there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from config.settings import Settings


def make_private_dirs(directory: Path) -> None:
    """Create the missing directories 0700; directories that exist are left as their owner set them."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for created in reversed(missing):
        created.mkdir(mode=0o700, exist_ok=True)
        os.chmod(created, 0o700)  # mkdir's mode passes through the umask


def data_dirs(settings: Settings) -> Iterable[Path]:
    """The folders the server's settings write into."""
    yield Path(settings.model_cache_dir)
    yield Path(settings.compile_cache_dir)
    yield Path(settings.batch_db_path).parent
    if settings.kv_disk_cache_path is not None:
        yield Path(settings.kv_disk_cache_path)
    if settings.is_disaggregated and settings.kv_handoff_path is not None:
        yield Path(settings.kv_handoff_path)


def prepare_data_dirs(settings: Settings) -> None:
    for directory in data_dirs(settings):
        make_private_dirs(directory)
