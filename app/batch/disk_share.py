"""Each tenant's share of the disk its files are stored on.

The per-tenant quotas (`max_file_bytes`) bound what one tenant keeps, but they may add up to more than
the disk holds: then one tenant's uploads could fill it, and every tenant's next write would fail. So
the bytes tenants may bring are bounded by the disk as it is too: `storage_reserve_bytes` stay free
for work already accepted (batch results, stored responses, the KV disk tier), and what is free above
that, with what all tenants already store, is split among the tenants by weight. A tenant past its
share gets 507 for its own upload, and the others keep theirs.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.batch.database import StorageFull


class DiskShareExceeded(StorageFull):
    """A tenant's upload would pass its share of the disk (or the reserve); nothing was stored."""


@dataclass(slots=True, frozen=True)
class DiskShare:
    directory: Path  # on the disk the files go to
    reserve_bytes: int
    fraction: float  # of the shared space, this tenant's: its weight over all the tenants' weights
    free_bytes: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free

    def check(self, tenant_bytes: int, all_bytes: int, size: int) -> None:
        """Raise DiskShareExceeded if `size` more bytes for a tenant storing `tenant_bytes` (of `all_bytes`
        stored by every tenant) would pass the reserve or the tenant's share."""
        usable = self.free_bytes(self.directory) - self.reserve_bytes
        if size > usable:
            raise DiskShareExceeded(f"the server's disk has {max(0, usable)} bytes free beyond what it keeps for "
                                    f"work already accepted, and this file has {size}")
        share = int((usable + all_bytes) * self.fraction)
        if tenant_bytes + size > share:
            raise DiskShareExceeded(f"this file ({size} bytes) would bring this tenant's stored files to "
                                    f"{tenant_bytes + size} bytes, over its share of the server's disk ({share} "
                                    "bytes: what is free and what every tenant stores, split by weight); delete "
                                    "some first")
