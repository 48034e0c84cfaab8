"""Every generating surface reads its body the same way: read (bounded), parse and validate (in a
worker thread when large, see off_loop.py), refuse what it cannot do, then check the model with the
tenant's rights. What differs is the surface's error shape, given as `BodyErrors`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from app.plumbing.asgi import read_body
from app.plumbing.errors import APIError, from_validation_error
from app.serving.context import ServingContext
from app.serving.off_loop import THREAD_BODY_BYTES
from app.serving.schemas import FieldRefused
from tenancy.tenants import Tenant


class RequestBody(Protocol):
    """What every generating surface's body has: the model it asks for, and the checks past pydantic's."""

    model: str

    def check_fields(self) -> None: ...


BodyT = TypeVar("BodyT", bound=BaseModel)


def refused_in_openai_shape(exc: FieldRefused) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)


@dataclass(slots=True, frozen=True)
class BodyErrors:
    """How a surface answers a body it cannot take: invalid (pydantic's errors) or refused (valid, but
    asking what the server does not do)."""

    invalid: Callable[[ValidationError], APIError] = from_validation_error
    refused: Callable[[FieldRefused], APIError] = refused_in_openai_shape


def validated(body_type: type[BodyT], raw: bytes | dict[str, Any], errors: BodyErrors = BodyErrors()) -> BodyT:
    """The body, or the 400 that says what is wrong with it or what it asks that we cannot do."""
    try:
        body = body_type.model_validate_json(raw) if isinstance(raw, bytes) else body_type.model_validate(raw)
        cast(RequestBody, body).check_fields()
    except ValidationError as exc:
        raise errors.invalid(exc) from None
    except FieldRefused as exc:
        raise errors.refused(exc) from None
    return body


async def parsed_body(context: ServingContext, request: Request, tenant: Tenant, body_type: type[BodyT],
                      errors: BodyErrors = BodyErrors()) -> BodyT:
    """The request's body, validated, for a model (the base model or a LoRA adapter) the tenant may use."""
    raw = await read_body(request, context.settings.max_body_bytes)
    body = await context.off_loop.run_if(len(raw) >= THREAD_BODY_BYTES, tenant.tenant_id, validated, body_type,
                                         raw, errors)
    context.check_model(cast(RequestBody, body).model, tenant)
    return body
