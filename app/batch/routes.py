"""The Files and Batch APIs in OpenAI's shapes, so `client.files` and `client.batches` work.

A tenant sees and touches only its own files and batches: another tenant's id answers 404, the
same as an id that does not exist. File content is never logged.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from app.batch.runner import BatchRunner
from app.batch.service import ACTIVE_STATUSES, CANCELLABLE_STATUSES, fail_validation, new_batch, parse_input_file
from app.batch.store import BatchStore, FileQuota, StoredFile
from app.batch.uploads import parse_upload_form, storage_errors
from app.plumbing.asgi import read_body
from app.plumbing.byte_rate import ByteRate
from app.plumbing.errors import APIError, from_validation_error, json_response
from app.serving.admission import AdmissionGate
from scheduling.request import PriorityClass
from tenancy.tenants import Tenant

FILE_PURPOSES = ("batch",)
MAX_LIST_LIMIT = 100


class CreateBatchBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class BatchRoutes:
    def __init__(self, gate: AdmissionGate, store: BatchStore, runner: BatchRunner, *, model_name: str,
                 max_upload_bytes: int, window_seconds: int, default_quota: FileQuota, byte_rate: ByteRate) -> None:
        self.gate = gate
        self.byte_rate = byte_rate  # each tenant's file transfers, shaped
        self.default_quota = default_quota  # for tenants whose entry sets no max_files / max_file_bytes
        self._reading_input = asyncio.Lock()
        self.store = store
        self.runner = runner
        self.model_name = model_name
        self.max_upload_bytes = max_upload_bytes
        self.window_seconds = window_seconds

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload_file, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.retrieve_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.retrieve_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
        ]

    # ---- files ----------------------------------------------------------------------------

    async def upload_file(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        form = await parse_upload_form(request, self.max_upload_bytes,
                                       lambda chunks: self.byte_rate.shaped(tenant.tenant_id, chunks))
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "Missing the 'file' part of the multipart form.", param="file")
            if purpose not in FILE_PURPOSES:
                raise APIError(400, f"Invalid purpose {purpose!r}; this server accepts {list(FILE_PURPOSES)}.",
                               param="purpose")
            with storage_errors("the file"):
                stored = await self.store.add_file(tenant.tenant_id, upload.filename or "upload.jsonl",
                                                   str(purpose), upload.file, self._quota_of(tenant))
        finally:
            await form.close()
        return json_response(stored.as_openai())

    async def list_files(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        files = await self.store.list_files(tenant.tenant_id, request.query_params.get("purpose"))
        return json_response({"object": "list", "data": [f.as_openai() for f in files], "has_more": False})

    async def retrieve_file(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        return json_response((await self._own_file(tenant, request.path_params["file_id"])).as_openai())

    async def delete_file(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        file_id = request.path_params["file_id"]
        if not await self.store.delete_file(tenant.tenant_id, file_id):
            raise _no_such("file", file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})

    async def file_content(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        file_id = request.path_params["file_id"]
        chunks = await self.store.file_chunks(tenant.tenant_id, file_id)
        if chunks is None:
            raise _no_such("file", file_id)
        return StreamingResponse(self.byte_rate.shaped(tenant.tenant_id, chunks), media_type="application/jsonl")

    def _quota_of(self, tenant: Tenant) -> FileQuota:
        limits, default = tenant.limits, self.default_quota
        disk = default.disk
        if disk is not None:  # the tenant's share of the disk: its weight over every listed tenant's
            total_weight = sum(t.weight for t in self.gate.tenants) or tenant.weight
            disk = replace(disk, fraction=min(1.0, tenant.weight / total_weight))
        return FileQuota(limits.max_files or default.max_files, limits.max_file_bytes or default.max_bytes, disk)

    async def _own_file(self, tenant: Tenant, file_id: str) -> StoredFile:
        stored = await self.store.get_file(tenant.tenant_id, file_id)
        if stored is None:
            raise _no_such("file", file_id)
        return stored

    # ---- batches --------------------------------------------------------------------------

    async def create_batch(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        self.gate.check_class(tenant, PriorityClass.BATCH)
        try:
            body = CreateBatchBody.model_validate_json(await read_body(request, 64 * 1024))
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        input_file = await self._own_file(tenant, body.input_file_id)
        if input_file.purpose != "batch":
            raise APIError(400, f"File {body.input_file_id} was not uploaded with purpose 'batch'.",
                           param="input_file_id")
        batch = new_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
        batch["expires_at"] = batch["created_at"] + self.window_seconds
        # An input file is read whole and parsed into its items: up to max_upload_bytes several times over.
        # One at a time, server-wide, so that parallel creations cannot multiply that by their number.
        async with self._reading_input:
            content = await self.store.file_content(tenant.tenant_id, body.input_file_id) or b""
            # Validating 50,000 lines takes a while: a worker thread does it, the loop goes on serving.
            parsed = await asyncio.to_thread(parse_input_file, content, body.endpoint, self.model_name)
            del content
        if parsed.errors:
            fail_validation(batch, parsed.errors, batch["created_at"])
        batch["request_counts"]["total"] = 0 if parsed.errors else len(parsed.items)
        with storage_errors("the batch"):
            await self.store.add_batch(tenant.tenant_id, batch, [] if parsed.errors else parsed.items)
        self.runner.wake()
        return json_response(batch)

    async def retrieve_batch(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        return json_response(await self._own_batch(tenant, request.path_params["batch_id"]))

    async def list_batches(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        limit = _list_limit(request.query_params.get("limit"))
        after = request.query_params.get("after")
        batches, has_more = await self.store.list_batches(tenant.tenant_id, after, limit)
        batches = [await self._with_live_counts(b) for b in batches]
        return json_response({"object": "list", "data": batches, "has_more": has_more,
                              "first_id": batches[0]["id"] if batches else None,
                              "last_id": batches[-1]["id"] if batches else None})

    async def cancel_batch(self, request: Request) -> Response:
        tenant = self.gate.authenticate(request)
        batch_id = request.path_params["batch_id"]
        # Checked and changed in one transaction: the runner may be ending this batch right now.
        with storage_errors("the cancellation"):
            batch, moved = await self.store.move_batch(tenant.tenant_id, batch_id, CANCELLABLE_STATUSES,
                                                       "cancelling", int(self.runner.clock()))
        if batch is None:
            raise _no_such("batch", batch_id)
        if not moved:
            raise APIError(409, f"Cannot cancel a batch that is {batch['status']}.", code="batch_not_cancellable")
        self.runner.wake()
        return json_response(await self._with_live_counts(batch))

    async def _own_batch(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        batch = await self.store.get_batch(tenant.tenant_id, batch_id)
        if batch is None:
            raise _no_such("batch", batch_id)
        return await self._with_live_counts(batch)

    async def _with_live_counts(self, batch: dict[str, Any]) -> dict[str, Any]:
        if batch["status"] in ACTIVE_STATUSES:
            batch["request_counts"] = await self.runner.counts(batch["id"])
        return batch


def _no_such(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind}: '{object_id}'.", param=f"{kind}_id", code="not_found")


def _list_limit(raw: str | None) -> int:
    if raw is None:
        return 20
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}.", param="limit")
    return int(raw)

