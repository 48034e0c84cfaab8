"""One JSON line per finished request, on the `fairlane.requests` logger.

Counts and times only: never prompt text, output text or keys, so the log can be shipped anywhere
the metrics go.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from scheduling.request import Request, TokenEvent

logger = logging.getLogger("fairlane.requests")


def _seconds(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 6)


def request_record(request: Request, event: TokenEvent, now: float) -> dict[str, Any]:
    """What the log line says about a request that ended at `now` with its final event."""
    return {
        "request_id": request.request_id,
        "tenant": request.tenant_id,
        "class": request.priority.value,
        "prompt_tokens": event.num_prompt_tokens,
        "cached_tokens": event.num_cached_tokens,
        "completion_tokens": event.num_output_tokens,
        "queue_time_s": _seconds(request.arrival_time, request.first_scheduled_time),
        "ttft_s": _seconds(request.arrival_time, request.first_token_time),
        "total_time_s": _seconds(request.arrival_time, now),
        "preemptions": request.num_preemptions,
        "finish_reason": event.finish_reason,
    }


def log_finished(request: Request, event: TokenEvent, now: float) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info(orjson.dumps(request_record(request, event, now)).decode())
