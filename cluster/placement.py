"""What the engine replicas ask Ray for. Ray-free, so it is tested without starting Ray."""

from __future__ import annotations

import math


def gpu_share(gpus_seen: float, num_replicas: int, device: str) -> float:
    """The GPUs each engine replica asks Ray for: one each while there are enough, else an equal share
    of those Ray sees (two replicas on one GPU get half each: asking one each would leave the second
    unplaced forever). Rounded down to Ray's four decimals so the shares never add up past the GPUs."""
    if device == "cpu" or gpus_seen <= 0:
        return 0.0
    return min(1.0, math.floor(gpus_seen / num_replicas * 10_000) / 10_000)
