"""What /stats says of the serving process itself, beside the engine's numbers: its pid (so a tool
on the same machine can read /proc/PID) and the asyncio tasks alive on its event loop (a task that
outlives its request is a leak no other number shows)."""

from __future__ import annotations

import asyncio
import os


def process_stats() -> dict[str, int]:
    """Called on the event loop (a route): `all_tasks` counts that loop's unfinished tasks."""
    return {"pid": os.getpid(), "asyncio_tasks": len(asyncio.all_tasks())}
