"""The Batch API's rules: validating an input file, the batch object and its lifecycle.

Statuses follow OpenAI: validating -> in_progress -> finalizing -> completed, or failed (bad
input), expired (the completion window ran out), cancelling -> cancelled.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")  # counts are live, from the items
# What the runner works on. A batch is finalizing only inside the transaction that ends it, so never
# in the store: the runner need not look for it.
RUNNER_STATUSES = ("validating", "in_progress", "cancelling")
CANCELLABLE_STATUSES = ("validating", "in_progress")
TIMESTAMP_FIELDS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                    "cancelling_at", "cancelled_at")


@dataclass(slots=True, frozen=True)
class LineError:
    code: str
    message: str
    line: int | None = None  # 1-based, as OpenAI reports it
    param: str | None = None

    def as_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(slots=True, frozen=True)
class ParsedInput:
    # (custom_id, body as JSON text) in file order. Text, not dicts: 60,000 parsed bodies kept alive
    # would set off a full garbage collection, which pauses every thread, the event loop's too.
    items: list[tuple[str, str]]
    errors: list[LineError]


def _check_line(number: int, raw: bytes, endpoint: str, model: str, seen: set[str]) -> tuple[
        tuple[str, str] | None, LineError | None]:
    try:
        entry = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, LineError("invalid_json_line", "This line is not valid JSON.", number)
    if not isinstance(entry, dict):
        return None, LineError("invalid_json_line", "Each line must be a JSON object.", number)
    custom_id, body = entry.get("custom_id"), entry.get("body")
    problem: LineError | None = None
    if not isinstance(custom_id, str) or not custom_id:
        problem = LineError("missing_required_parameter", "custom_id must be a non-empty string.", number, "custom_id")
    elif custom_id in seen:
        problem = LineError("duplicate_custom_id", f"The custom_id '{custom_id}' appears more than once.", number,
                            "custom_id")
    elif entry.get("method") != "POST":
        problem = LineError("invalid_method", "method must be POST.", number, "method")
    elif entry.get("url") != endpoint:
        problem = LineError("mismatched_endpoint", f"url {entry.get('url')!r} differs from the batch's endpoint "
                                                   f"{endpoint!r}.", number, "url")
    elif not isinstance(body, dict):
        problem = LineError("invalid_request", "body must be a JSON object.", number, "body")
    elif body.get("model") != model:
        problem = LineError("model_not_found", f"The model {body.get('model')!r} does not exist; this server "
                                               f"serves {model!r}.", number, "body.model")
    if problem is not None:
        return None, problem
    assert isinstance(custom_id, str) and isinstance(body, dict)
    seen.add(custom_id)
    return (custom_id, orjson.dumps(body).decode()), None


def parse_input_file(content: bytes, endpoint: str, model: str, max_errors: int = 20) -> ParsedInput:
    """Validate every line; any problem fails the whole batch, as OpenAI does."""
    items: list[tuple[str, str]] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        item, error = _check_line(number, raw, endpoint, model, seen)
        if error is not None:
            errors.append(error)
            if len(errors) >= max_errors:
                break
        elif item is not None:
            items.append(item)
    if not items and not errors:
        errors.append(LineError("empty_file", "The input file has no requests."))
    return ParsedInput(items, errors)


def new_batch(input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None,
              now: int | None = None) -> dict[str, Any]:
    created = int(time.time()) if now is None else now
    batch: dict[str, Any] = {
        "id": "batch_" + uuid.uuid4().hex, "object": "batch", "endpoint": endpoint, "errors": None,
        "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": created,
        "expires_at": created + COMPLETION_WINDOWS.get(completion_window, 24 * 3600),
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
    }
    batch.update(dict.fromkeys(TIMESTAMP_FIELDS))
    return batch


def fail_validation(batch: dict[str, Any], errors: list[LineError], now: int) -> None:
    batch.update(status="failed", failed_at=now,
                 errors={"object": "list", "data": [e.as_openai() for e in errors]})


def output_line(custom_id: str, request_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of the output or error file, in OpenAI's format."""
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}
