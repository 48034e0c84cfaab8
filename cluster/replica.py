"""One engine replica: a fairlane engine (model, runner, scheduler) as a Ray Serve deployment.

The ingress streams each request's token events from `generate`. Ray Serve cancels the call when
the ingress gives up on it (its client left, a stop string matched), and the cancellation aborts the
request here, freeing its KV blocks at the next step. Every `vtc_sync_interval_s` the replica
reports to the board (service given, health, /stats) and folds in the other replicas' service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict
from typing import Any, Literal

from ray import serve

from cluster.addresses import bind_replica_grpc_to_node_address
from cluster.replica_calls import ReplicaCalls
from cluster.service import ServiceMeter
from cluster.wire import HandoffNote, ReplicaCall, ReplicaDescription, ReplicaReport
from config.settings import Settings
from contract.plan import StructuredOutput
from scheduling.request import TokenEvent

logger = logging.getLogger(__name__)

ReplicaRole = Literal["colocated", "prefill", "decode"]


class EngineReplica:
    async def __init__(self, settings: Settings, board: Any, role: ReplicaRole = "colocated") -> None:  # type: ignore[misc]  # Serve awaits it
        self._settings = settings
        self._board = board  # the ClusterBoard actor's handle
        self.role = role
        bind_replica_grpc_to_node_address()
        from app.process.engine_factory import build_engine  # imports torch: in the replicas' processes only
        from cluster.handoff_runner import block_reader, open_publisher

        self.engine, runner = build_engine(settings)
        self._runner = runner
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        handoff_root = settings.kv_handoff_path or ""  # set whenever a cluster has roles (Settings checks)
        publisher = (open_publisher(runner, handoff_root, self.replica_id, settings.kv_handoff_bytes)
                     if role == "prefill" else None)
        read_blocks = block_reader(runner, handoff_root) if role == "decode" else None
        self.calls = ReplicaCalls(self.engine, self.replica_id, publisher, read_blocks)
        self._meter = ServiceMeter(self.engine.scheduler)
        await self.engine.start()
        self._sync_task = asyncio.create_task(self._sync_forever(), name="fairlane-board-sync")

    async def prefill(self, call: ReplicaCall) -> AsyncGenerator[list[TokenEvent] | HandoffNote, None]:
        """A prefill replica's part of a request (cluster.replica_calls.ReplicaCalls.prefill)."""
        async for item in self.calls.prefill(call):
            yield item

    async def generate(self, call: ReplicaCall) -> AsyncGenerator[list[TokenEvent] | HandoffNote, None]:
        """The request's events (cluster.replica_calls.ReplicaCalls.generate)."""
        async for item in self.calls.generate(call):
            yield item

    def describe(self) -> ReplicaDescription:
        return ReplicaDescription(self.replica_id, self._runner.loaded.tokenizer, self._runner.geometry,
                                  self.engine.tenants)

    def check_structured(self, structured: StructuredOutput) -> None:
        """Raises ValueError for a grammar the runner cannot compile (the ingress answers 400)."""
        self._runner.check_structured(structured)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine died or stalled is restarted."""
        health = self.engine.health()
        if not health.is_healthy:
            raise RuntimeError(health.reason or "the engine is unhealthy")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request router reads of this replica's load (cluster/router.py)."""
        snapshot = self.engine.snapshot
        return {"kv_use": snapshot.kv_blocks.fraction, "kv_blocks": snapshot.kv_blocks.total,
                "waiting": snapshot.waiting, "running": snapshot.running}

    def stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "role": self.role, "pid": os.getpid(), **self.engine.stats(),
                "handoff": asdict(self.calls.handoff)}

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.vtc_sync_interval_s)
            try:
                await self._sync_once()
            except Exception:  # the board may be restarting: the service goes out with the next report
                logger.warning("replica %s could not reach the board", self.replica_id, exc_info=True)

    async def _sync_once(self) -> None:
        health = self.engine.health()
        service = self._meter.take()
        report = ReplicaReport(self.replica_id, service, health.is_healthy, health.reason,
                               self.stats(), time.time(), self.engine.snapshot)
        try:
            others = await self._board.exchange.remote(report)
        except Exception:
            self._meter.give_back(service)
            raise
        if self._settings.share_vtc:
            self.engine.fold_service(others)  # applied by the engine's task, as every change to its scheduler

    async def __del__(self) -> None:
        sync_task: asyncio.Task[None] | None = getattr(self, "_sync_task", None)  # None when __init__ failed
        if sync_task is None:
            return
        sync_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sync_task
        await self.engine.shutdown()
