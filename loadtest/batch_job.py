"""One Batch API job as a client runs it: upload a JSONL file, create the batch, poll it to a final
status, download the output and error files, and give each item its record.

The client cannot see when an item ends, only when its batch does: every item's end-to-end time is
its batch's (an upper bound), and it has no TTFT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx

from loadtest.client import (
    ERROR_RESPONSE,
    OK,
    UNFINISHED,
    RequestRecord,
    take_refusal,
    take_transport_failure,
)
from loadtest.workload import ChatRequest, LoadTenant

CHAT_PATH = "/v1/chat/completions"
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
POLL_S = 0.5
BATCH_ITEM_ERROR = "batch item error"  # the error file's line for the item; detail: its message


async def run_batch_job(http: httpx.AsyncClient, model: str, items: list[ChatRequest], records: list[RequestRecord],
                        clock: Callable[[], float], summaries: list[dict[str, Any]]) -> None:
    """Run items as one batch of their (common) tenant; fills records and appends a summary."""
    tenant = items[0].tenant
    custom_ids = [f"{tenant.tenant_id}-{i}" for i in range(len(items))]
    summary: dict[str, Any] = {"tenant": tenant.tenant_id, "batch_id": None, "status": "not_created",
                               "items": len(items)}
    summaries.append(summary)
    try:
        batch = await _create(http, tenant, _input_file(model, items, custom_ids))
        if isinstance(batch, httpx.Response):
            _end_all(records, clock(), partial(take_refusal, response=batch))
            return
        summary["batch_id"] = batch["id"]
        batch = await _poll(http, tenant, batch["id"])
        done_at = clock()
        summary |= {"status": batch["status"], "seconds": round(done_at - records[0].sent_at, 3),
                    "request_counts": batch.get("request_counts")}
        results = await _results(http, tenant, batch)
        for custom_id, record in zip(custom_ids, records, strict=True):
            _fill(record, results.get(custom_id), f"batch_{batch['status']}", done_at)
    except httpx.RequestError as exc:
        _end_all(records, clock(), partial(take_transport_failure, exc=exc))
    except asyncio.CancelledError:
        if summary["batch_id"] is not None:  # the run is over: do not leave the server working for nobody
            await _cancel_quietly(http, tenant, summary["batch_id"])
        raise


def _input_file(model: str, items: list[ChatRequest], custom_ids: list[str]) -> bytes:
    lines = [json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_PATH,
                         "body": item.body(model, stream=False)})
             for custom_id, item in zip(custom_ids, items, strict=True)]
    return ("\n".join(lines) + "\n").encode()


async def _create(http: httpx.AsyncClient, tenant: LoadTenant, content: bytes) -> dict[str, Any] | httpx.Response:
    """The created batch, or the response that refused the upload or the creation."""
    upload = await http.post("/v1/files", headers=tenant.headers, data={"purpose": "batch"},
                             files={"file": ("loadtest.jsonl", content, "application/jsonl")})
    if upload.status_code != 200:
        return upload
    created = await http.post("/v1/batches", headers=tenant.headers, json={
        "input_file_id": upload.json()["id"], "endpoint": CHAT_PATH, "completion_window": "24h"})
    if created.status_code != 200:
        return created
    batch: dict[str, Any] = created.json()
    return batch


async def _poll(http: httpx.AsyncClient, tenant: LoadTenant, batch_id: str) -> dict[str, Any]:
    while True:
        response = await http.get(f"/v1/batches/{batch_id}", headers=tenant.headers)
        response.raise_for_status()
        batch: dict[str, Any] = response.json()
        if batch["status"] in FINAL_STATUSES:
            return batch
        await asyncio.sleep(POLL_S)


async def _results(http: httpx.AsyncClient, tenant: LoadTenant, batch: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each item's line of the output or error file, by custom_id."""
    lines: dict[str, dict[str, Any]] = {}
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            response = await http.get(f"/v1/files/{batch[key]}/content", headers=tenant.headers)
            response.raise_for_status()
            for raw in response.text.splitlines():
                if raw.strip():
                    line = json.loads(raw)
                    lines[line["custom_id"]] = line
    return lines


def _fill(record: RequestRecord, line: dict[str, Any] | None, missing: str, done_at: float) -> None:
    record.e2e_s = done_at - record.sent_at
    if line is None:
        record.outcome = missing  # the batch ended (failed validation, say) without this item
        return
    response = line.get("response")
    if response is None:
        error = line.get("error") or {}
        record.fail(str(error.get("code") or missing), BATCH_ITEM_ERROR, error.get("message"))
        return
    # The item's request id is its completion's id, the one the server's request log names.
    record.status, record.completion_id = response["status_code"], response.get("request_id") or None
    body = response.get("body") or {}
    if record.status != 200:
        message = (body.get("error") or {}).get("message")
        record.fail(str(record.status), ERROR_RESPONSE, None if message is None else str(message))
        return
    record.outcome = OK
    usage = body.get("usage") or {}
    record.prompt_tokens = int(usage.get("prompt_tokens", 0))
    record.completion_tokens = int(usage.get("completion_tokens", 0))
    record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    record.chunk_times = [done_at]  # the client sees the tokens when it downloads them


def _end_all(records: list[RequestRecord], now: float, end: Callable[[RequestRecord], None]) -> None:
    """End each record still unfinished as `end` says."""
    for record in records:
        if record.outcome == UNFINISHED:
            end(record)
            record.e2e_s = now - record.sent_at


async def _cancel_quietly(http: httpx.AsyncClient, tenant: LoadTenant, batch_id: str) -> None:
    with contextlib.suppress(httpx.HTTPError, TimeoutError):
        await asyncio.wait_for(http.post(f"/v1/batches/{batch_id}/cancel", headers=tenant.headers), timeout=5)


async def run_cancelled_batch_job(http: httpx.AsyncClient, model: str, items: list[ChatRequest], record: RequestRecord,
                                  clock: Callable[[], float], summaries: list[dict[str, Any]],
                                  cancel_after_s: float) -> None:
    """Create a batch of items, cancel it after cancel_after_s, and wait for it to end. The record is the
    job's: OK once the batch reached a final status after the cancel (cancelled, or completed when it
    was quicker), else the status that refused it."""
    tenant = items[0].tenant
    summary: dict[str, Any] = {"tenant": tenant.tenant_id, "batch_id": None, "status": "not_created",
                               "items": len(items), "cancel_after_s": round(cancel_after_s, 3)}
    summaries.append(summary)
    try:
        batch = await _create(http, tenant, _input_file(model, items, [f"c-{i}" for i in range(len(items))]))
        if isinstance(batch, httpx.Response):
            take_refusal(record, batch)
            return
        summary["batch_id"] = batch["id"]
        await asyncio.sleep(cancel_after_s)
        # A batch that ended before the cancel arrived is refused its cancel: the poll below still ends.
        cancel = await http.post(f"/v1/batches/{batch['id']}/cancel", headers=tenant.headers)
        batch = await _poll(http, tenant, batch["id"])
        summary |= {"status": batch["status"], "cancel_status": cancel.status_code,
                    "request_counts": batch.get("request_counts")}
        record.outcome = OK if cancel.status_code == 200 or batch["status"] != "cancelled" else str(cancel.status_code)
    except httpx.RequestError as exc:
        take_transport_failure(record, exc)
    finally:
        record.e2e_s = clock() - record.sent_at
