"""The Ray Serve request router of the replicas' deployment (`cluster_router = "prefix_load"`): Ray
Serve's pluggable RequestRouter, fed by cluster/routing.py's decisions.

It runs in the ingress's process, inside Ray Serve's handle. In-flight counts are its own (every
request it routes, until Ray Serve says it completed); KV use comes from each replica's routing
stats (EngineReplica.record_routing_stats), reported every `cluster_stats_period_s`.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.routing import LoadLimits, PrefixMemory, ReplicaLoad, rank_replicas
from cluster.wire import ReplicaCall


def _chain_of(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None:
        return ()
    call = next((arg for arg in pending_request.args if isinstance(arg, ReplicaCall)), None)
    return call.block_hashes if call is not None else ()


class PrefixLoadRouter(FIFOMixin, RequestRouter):  # type: ignore[misc]
    def initialize_state(self, max_imbalance: int = 4, max_kv_use: float = 0.9, **kwargs: Any) -> None:
        self._limits = LoadLimits(max_imbalance, max_kv_use)
        self._memory = PrefixMemory()
        self._in_flight: Counter[str] = Counter()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        chain = _chain_of(pending_request)
        matched = {rid: self._memory.matched_blocks(rid, chain) for rid in by_id}
        loads = {rid: ReplicaLoad(self._in_flight[rid], float(r.routing_stats.get("kv_use", 0.0)))
                 for rid, r in by_id.items()}
        for rid, replica in by_id.items():
            num_blocks = replica.routing_stats.get("kv_blocks")
            if isinstance(num_blocks, int):
                self._memory.set_capacity(rid, num_blocks)
        ids = list(by_id)
        random.shuffle(ids)  # equally good replicas take turns instead of the first one taking all
        ranked = rank_replicas(ids, matched, loads, self._limits)
        # One replica per rank: Ray Serve tries the first, and the next only if it refuses (full queue).
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._in_flight[replica_id.unique_id] += 1
        self._memory.record(replica_id.unique_id, _chain_of(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight[replica_id.unique_id] > 0:
            self._in_flight[replica_id.unique_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self._memory.keep_only(live)
        for gone in [rid for rid in self._in_flight if rid not in live]:
            del self._in_flight[gone]
