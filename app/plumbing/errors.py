"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with a status.

Every failure a client can cause is an `APIError` raised by the handlers, or a Starlette
`HTTPException` (unknown route, wrong method) turned into the same shape; nothing a client sends
may surface as a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"

_TYPE_OF_STATUS = {400: INVALID_REQUEST, 404: NOT_FOUND, 405: INVALID_REQUEST, 413: INVALID_REQUEST,
                   503: UNAVAILABLE}
_CODE_OF_STATUS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    """An error answered to the client as is."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_OF_STATUS.get(status, SERVER_ERROR)
        self.param = param
        self.code = code if code is not None else _CODE_OF_STATUS.get(status)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_response(content: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code=status, headers=headers, media_type="application/json")


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first offending field, in the dotted form OpenAI uses."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    location = ".".join(str(part) for part in first["loc"])
    if first["type"] == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {location}"
    elif location:
        message = f"Invalid value for '{location}': {first['msg']}"
    else:
        message = f"Invalid request body: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    param = str(first["loc"][0]) if first["loc"] else None
    return APIError(400, message, param=param, code="invalid_value")


def deepest_problem(exc: ValidationError) -> tuple[str, Any]:
    """(dotted location, error) of the deepest of a body's validation errors. Where a field may take
    several shapes (a string or a list of blocks), the first error is the least telling ("not a
    string"): the client meant the shape that got further. pydantic names the union member it tried in
    the location (`list[...]`, `str`); that is no field of the body, so it is left out."""
    errors = exc.errors(include_url=False)
    deepest = max(errors, key=lambda error: len(error["loc"]))
    location = ".".join(str(part) for part in deepest["loc"] if not _is_union_label(part))
    return location, deepest


def _is_union_label(part: str | int) -> bool:
    return isinstance(part, str) and ("[" in part or part == "str")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return json_response(exc.body(), exc.status, exc.headers)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"No route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    error = APIError(exc.status_code, message, headers=exc.headers)
    return json_response(error.body(), error.status, error.headers)


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    """A bug, not a client's fault: log it whole, answer without internals."""
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response(error_body("The server had an error while processing the request.", SERVER_ERROR),
                         500)
