"""Where a request should go: the replica whose prefix cache holds the longest part of its salted
block-hash chain, unless that replica is overloaded; then the least loaded one.

Ray-free decisions (the Ray Serve router in cluster/router.py only feeds them), so they are tested
without a cluster. The router cannot see a replica's cache; it remembers, per replica, the block
hashes of the prompts it sent there, forgetting the oldest beyond the replica's number of KV blocks
(the cache evicts least recently used blocks too). Salted hashes keep tenants apart here as in the
cache itself: one tenant's prompt never draws another's to the replica that cached it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_REMEMBERED_BLOCKS = 4096  # until a replica reports its number of KV blocks


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    in_flight: int  # requests routed there and not finished (counted by the router itself: never stale)
    kv_use: float = 0.0  # share of its KV blocks in use, from its last routing stats


@dataclass(slots=True, frozen=True)
class LoadLimits:
    max_imbalance: int  # in-flight requests beyond the least loaded replica's: overloaded
    max_kv_use: float  # KV share in use at or past which a replica is overloaded


def is_overloaded(load: ReplicaLoad, least_in_flight: int, limits: LoadLimits) -> bool:
    return load.in_flight - least_in_flight > limits.max_imbalance or load.kv_use >= limits.max_kv_use


def rank_replicas(candidates: Sequence[str], matched_blocks: Mapping[str, int], loads: Mapping[str, ReplicaLoad],
                  limits: LoadLimits) -> list[str]:
    """Candidates best first: the longest cached prefix among replicas not overloaded, then the rest
    least loaded first. With no cached prefix anywhere, least loaded first."""
    if not candidates:
        return []
    idle = ReplicaLoad(0)
    by_load = sorted(candidates, key=lambda r: (loads.get(r, idle).in_flight, loads.get(r, idle).kv_use))
    least = loads.get(by_load[0], idle).in_flight
    fit = [r for r in by_load if not is_overloaded(loads.get(r, idle), least, limits)]
    best = max(fit, key=lambda r: matched_blocks.get(r, 0), default=None)  # ties: the less loaded
    if best is None or matched_blocks.get(best, 0) == 0:
        return by_load
    return [best, *(r for r in by_load if r != best)]


class PrefixMemory:
    """Per replica, the block hashes recently routed there, least recently used first."""

    def __init__(self) -> None:
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}

    def matched_blocks(self, replica_id: str, chain: Sequence[bytes]) -> int:
        """How many leading blocks of the chain the replica probably holds."""
        blocks = self._blocks.get(replica_id)
        if not blocks:
            return 0
        count = 0
        for block_hash in chain:
            if block_hash not in blocks:
                break
            count += 1
        return count

    def record(self, replica_id: str, chain: Sequence[bytes]) -> None:
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for block_hash in chain:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        capacity = self._capacity.get(replica_id, DEFAULT_REMEMBERED_BLOCKS)
        while len(blocks) > capacity:
            blocks.popitem(last=False)

    def set_capacity(self, replica_id: str, num_blocks: int) -> None:
        self._capacity[replica_id] = max(1, num_blocks)

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone: a restarted replica starts with an empty cache."""
        keep = set(replica_ids)
        for gone in [r for r in self._blocks if r not in keep]:
            del self._blocks[gone]
            self._capacity.pop(gone, None)
