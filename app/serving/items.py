"""Running one whole request for a caller that is not an HTTP client (the Batch API's items): the
contract between the surface that runs it and the caller, so that neither imports the other. The
server hands the OpenAI surface's `run_batch_item` to the batch runner as an `ItemExecutor`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

# (tenant, url, body) -> (HTTP status, request id, response body); runs one item as its endpoint
# runs a request without streaming.
ItemExecutor = Callable[[str, str, dict[str, Any]], Awaitable[tuple[int, str, dict[str, Any]]]]


class RetryLater(Exception):
    """An item the server cannot take now (overloaded, or draining): it stays pending for a later try."""
