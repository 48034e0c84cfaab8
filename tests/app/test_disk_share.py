"""Each tenant's share of the disk (app/batch/disk_share.py), with the disk's free space given."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.batch.disk_share import DiskShare, DiskShareExceeded

MIB = 1024 * 1024


def share(free: int, reserve: int, fraction: float) -> DiskShare:
    return DiskShare(Path("."), reserve, fraction, free_bytes=lambda _: free)


def test_the_space_beyond_the_reserve_and_what_is_stored_is_split_by_weight() -> None:
    heavy = share(free=100 * MIB, reserve=20 * MIB, fraction=0.75)  # (80 + 40 stored) * 0.75 = 90 MiB
    heavy.check(tenant_bytes=30 * MIB, all_bytes=40 * MIB, size=60 * MIB)
    with pytest.raises(DiskShareExceeded, match="over its share"):
        heavy.check(tenant_bytes=30 * MIB, all_bytes=40 * MIB, size=61 * MIB)
    light = share(free=100 * MIB, reserve=20 * MIB, fraction=0.25)  # 30 MiB
    with pytest.raises(DiskShareExceeded, match="over its share"):
        light.check(tenant_bytes=10 * MIB, all_bytes=40 * MIB, size=21 * MIB)


def test_nothing_goes_into_the_reserve() -> None:
    with pytest.raises(DiskShareExceeded, match="keeps for work already accepted"):
        share(free=100 * MIB, reserve=99 * MIB, fraction=1.0).check(0, 0, 2 * MIB)
