"""The Batch API assembled: its SQLite store, its runner and its routes, built from the settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from starlette.routing import Route

from app.batch.disk_share import DiskShare
from app.batch.routes import BatchRoutes
from app.batch.runner import BatchRunner
from app.batch.store import BatchStore, FileQuota
from app.plumbing.byte_rate import ByteRate
from app.serving.admission import AdmissionGate
from app.serving.items import ItemExecutor
from config.settings import Settings


@dataclass(slots=True)
class BatchAPI:
    store: BatchStore
    runner: BatchRunner
    routes: list[Route]

    @classmethod
    def build(cls, settings: Settings, gate: AdmissionGate, execute: ItemExecutor, model_name: str) -> BatchAPI:
        """Opens and checks the database: raises DatabaseUnusable (a StoreError naming the path) when the
        file is not a sound SQLite database, so start-up stops there instead of answering 500s later."""
        store = BatchStore(settings.batch_db_path)
        runner = BatchRunner(store, execute, max_in_flight=settings.batch_max_in_flight,
                             poll_seconds=settings.batch_poll_s, weight_of=gate.tenants.weight,
                             is_tenant=gate.tenants.is_listed)
        disk = DiskShare(Path(settings.batch_db_path).parent, settings.storage_reserve_bytes, fraction=1.0)
        quota = FileQuota(settings.tenant_max_files, settings.tenant_max_file_bytes, disk)
        routes = BatchRoutes(gate, store, runner, model_name=model_name, max_upload_bytes=settings.max_upload_bytes,
                             window_seconds=settings.batch_window_s, default_quota=quota,
                             byte_rate=ByteRate(settings.tenant_file_bytes_per_s)).routes()
        return cls(store, runner, routes)

    async def stop(self) -> None:
        """Items still running stay pending in the store: a restarted server runs them again."""
        await self.runner.stop()
        await self.store.close()
