"""The server seen from outside, one sample every few seconds: its /stats (engine numbers and the
asyncio tasks of its event loop), the size of its /metrics, and what /proc says of its process
(resident memory, open file descriptors, threads) and of the SQLite files it holds open.

Needs the server on this machine for /proc; the pid comes from /stats (`process.pid`) unless given.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import read_stats

METRICS_PATH = "/metrics"
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
WAL_SUFFIX = "-wal"


@dataclass(slots=True, frozen=True)
class Sample:
    """One look at the server. Sizes in bytes; None where the source could not be read."""

    at_s: float  # seconds since the soak began
    phase: str  # warmup, baseline, load, idle
    rss_bytes: int | None
    num_fds: int | None
    num_threads: int | None
    asyncio_tasks: int | None
    running: int | None
    waiting: int | None
    kv_blocks_in_use: int | None
    cpu_blocks_in_use: int | None  # the swap pool
    swapped_out_blocks: int | None  # blocks swapped out since the start (a counter)
    db_bytes: int | None
    wal_bytes: int | None
    metrics_bytes: int | None  # the exposition's size: grows with label sets that are never dropped

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (bytes) and Threads from /proc/PID/status."""
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            found["rss_bytes"] = int(value.split()[0]) * 1024
        elif key == "Threads":
            found["num_threads"] = int(value)
    return found


def open_files(pid: int) -> list[str]:
    """The targets of the process's file descriptors (sockets and pipes read as such)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in fd_dir.iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:  # closed between the listing and the read
            continue
    return targets


def sqlite_files(targets: list[str]) -> tuple[int | None, int | None]:
    """Sizes of the SQLite database the server holds open and of its write-ahead log."""
    databases = [t for t in targets if t.endswith(SQLITE_SUFFIXES)]
    if not databases:
        return None, None
    db = Path(databases[0])
    wal = db.with_name(db.name + WAL_SUFFIX)
    return _size(db), _size(wal)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


class ServerProbe:
    def __init__(self, http: httpx.AsyncClient, admin_key: str | None, pid: int | None, start: float) -> None:
        self._http = http
        self._admin_key = admin_key
        self.pid = pid
        self._start = start

    async def sample(self, phase: str) -> Sample:
        stats = await read_stats(self._http, self._admin_key)
        if self.pid is None:
            self.pid = stats.get("process", {}).get("pid")
        process = self._process_numbers()
        return Sample(
            at_s=round(time.perf_counter() - self._start, 3), phase=phase,
            rss_bytes=process.get("rss_bytes"), num_fds=process.get("num_fds"),
            num_threads=process.get("num_threads"), asyncio_tasks=stats.get("process", {}).get("asyncio_tasks"),
            running=stats.get("running"), waiting=stats.get("waiting"),
            kv_blocks_in_use=stats.get("kv_blocks_in_use"), cpu_blocks_in_use=stats.get("cpu_blocks_in_use"),
            swapped_out_blocks=stats.get("swap", {}).get("blocks_out"),
            db_bytes=process.get("db_bytes"), wal_bytes=process.get("wal_bytes"),
            metrics_bytes=await self._metrics_size())

    def _process_numbers(self) -> dict[str, int | None]:
        if self.pid is None:
            return {}
        try:
            targets = open_files(self.pid)
            db_bytes, wal_bytes = sqlite_files(targets)
            return {**proc_status(self.pid), "num_fds": len(targets), "db_bytes": db_bytes, "wal_bytes": wal_bytes}
        except OSError:  # another machine's pid, or the process is gone: the HTTP numbers still count
            return {}

    async def _metrics_size(self) -> int | None:
        headers = {"authorization": f"Bearer {self._admin_key}"} if self._admin_key else None
        try:
            response = await self._http.get(METRICS_PATH, headers=headers)
        except httpx.HTTPError:
            return None
        return len(response.content) if response.status_code == 200 else None
