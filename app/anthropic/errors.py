"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with its statuses.

Every handler of the Messages API runs inside `anthropic_errors`, which turns whatever it raises (the
gate's 401/403/429, a body too large or too slow, a validation error, an engine failure, a bug) into
an `AnthropicError`. That is an `APIError` still carrying the chat machinery's status and code, so the
rejection metrics count it as they count any other; only its rendering differs: Anthropic's body, and
529 where the server is overloaded or going away (the chat endpoints' 503).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from app.plumbing.asgi import ClientGone
from app.plumbing.errors import SERVER_ERROR, APIError, deepest_problem, json_response
from app.serving.schemas import FieldRefused

logger = logging.getLogger(__name__)

OVERLOADED_STATUS = 529  # Anthropic's "overloaded": retried by its clients, as a 503 would be
INVALID_REQUEST = "invalid_request_error"
_TYPE_OF_STATUS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", OVERLOADED_STATUS: "overloaded_error"}

Handler = Callable[[Request], Awaitable[Response]]
POST_ONLY = frozenset({"POST"})


class AnthropicError(APIError):
    """An APIError answered in Anthropic's shape."""

    @classmethod
    def of(cls, error: APIError) -> AnthropicError:
        """The same error; its message names the field it is about, as Anthropic's do (there is no param)."""
        message = error.message
        if error.param and not message.startswith(f"{error.param}:"):
            message = f"{error.param}: {message}"
        return cls(error.status, message, type=error.type, param=error.param, code=error.code, headers=error.headers)

    @property
    def wire_status(self) -> int:
        return OVERLOADED_STATUS if self.status == 503 else self.status

    @property
    def error_type(self) -> str:
        status = self.wire_status
        return _TYPE_OF_STATUS.get(status, "api_error" if status >= 500 else INVALID_REQUEST)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}


async def anthropic_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, AnthropicError)
    return json_response(exc.body(), exc.wire_status, exc.headers)


def anthropic_errors(handler: Handler, methods: frozenset[str] | None = POST_ONLY) -> Handler:
    """The handler, with every failure raised as an AnthropicError, and a method not in `methods`
    (None: any will do) refused as one."""

    async def answer(request: Request) -> Response:
        try:
            if methods is not None and request.method not in methods:
                raise APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                               code="method_not_allowed")
            return await handler(request)
        except AnthropicError:
            raise
        except APIError as exc:
            raise AnthropicError.of(exc) from None
        except ClientGone:
            raise  # nobody is left to answer
        except Exception as exc:  # a bug, not the client's fault: logged whole, answered without internals
            logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
            raise AnthropicError(500, "The server had an error while processing the request.",
                                 type=SERVER_ERROR) from None

    return answer


def not_found(request: Request) -> APIError:
    return APIError(404, f"No route for {request.method} {request.url.path}")


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the offending field as Anthropic does (`messages.0.content.1.text: Field required`)."""
    location, problem = deepest_problem(exc)
    if problem["type"] == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {problem['msg']}", code="invalid_json")
    message = "Extra inputs are not permitted" if problem["type"] == "extra_forbidden" else problem["msg"]
    return APIError(400, f"{location}: {message}" if location else message, code="invalid_value")


def field_refused(exc: FieldRefused) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)

