"""Who may ask, for which class, and how much: authentication, class rights and quotas at the door.

Every admitted request holds a quota `Admission` until the engine ends it; the gate is an engine
observer, so the release happens on the request's final event whatever ended it (its last token,
a stop string, an abort, a client gone, a shutdown). Before the engine has the request, the quota is
held by `holding()`: whatever fails between the gate and the engine gives it back, once
(`TenantQuotas.release` of an admission already released does nothing).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from starlette.requests import Request

from app.plumbing.errors import APIError
from scheduling.engine import EngineFront
from scheduling.request import PriorityClass, RequestId, TokenEvent
from scheduling.request import Request as EngineRequest
from tenancy.quotas import Admission, QuotaExceeded, TenantQuotas
from tenancy.tenants import Tenant, TenantRegistry

PERMISSION_ERROR = "permission_error"
RATE_LIMIT_ERROR = "rate_limit_error"
AUTHENTICATION_ERROR = "invalid_request_error"


def bearer_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def api_key(request: Request) -> str | None:
    """The key a client presents: OpenAI's clients send it as a Bearer token, Anthropic's as `x-api-key`."""
    return bearer_key(request) or request.headers.get("x-api-key", "").strip() or None


def basic_password(request: Request) -> str | None:
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        _, _, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return password or None


class AdmissionGate:
    def __init__(self, tenants: TenantRegistry, engine: EngineFront) -> None:
        self.tenants = tenants
        self.quotas = TenantQuotas(tenants)
        self._held: dict[str, Admission] = {}
        engine.observers.append(self)

    def authenticate(self, request: Request) -> Tenant:
        """The caller's tenant, or 401. Sets request.state.tenant_id for logs and metrics."""
        key = api_key(request)
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            message = ("You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
                       if key is None
                       else "Incorrect API key provided.")
            raise APIError(401, message, type=AUTHENTICATION_ERROR, code="invalid_api_key")
        request.state.tenant_id = tenant.tenant_id
        return tenant

    def authorize_operator(self, request: Request) -> None:
        """The operator endpoints take the admin key (as a Bearer token, or as the password of HTTP
        Basic auth, which a browser asks for on the dashboard); a tenant's key gets 403."""
        key = bearer_key(request) or basic_password(request)
        if self.tenants.is_admin(key):
            return
        if key is not None and self.tenants.authenticate(key) is not None:
            raise APIError(403, "This endpoint is for operators: it needs the admin key, not a tenant's.",
                           type=PERMISSION_ERROR, code="admin_key_required")
        message = "This endpoint needs the admin key." if key is None else "Incorrect admin key provided."
        raise APIError(401, message, type=AUTHENTICATION_ERROR, code="invalid_api_key",
                       headers={"www-authenticate": 'Basic realm="fairlane operator"'})

    @staticmethod
    def check_class(tenant: Tenant, priority: PriorityClass) -> None:
        if priority.value not in tenant.classes:
            raise APIError(403, f"This API key may not use the {priority.value} class "
                                f"(allowed: {', '.join(sorted(tenant.classes))}).",
                           type=PERMISSION_ERROR, param="service_tier", code="class_not_allowed")

    def admit(self, tenant: Tenant, request: EngineRequest) -> Admission:
        """Take the tenant's quota for this request, or raise the 429/400 to answer."""
        try:
            admission = self.quotas.admit(tenant, request.num_prompt_tokens, request.max_tokens)
        except QuotaExceeded as exc:
            raise _api_error(exc) from None
        self._held[request.request_id] = admission
        return admission

    @contextmanager
    def holding(self, tenant: Tenant, requests: Sequence[EngineRequest]) -> Iterator[dict[str, str]]:
        """Take the tenant's quota for every request, or for none; inside, any exception gives every one
        back. Yields the rate-limit headers to answer with. Once the block ends normally the engine holds
        the requests, and each one's final event releases its quota."""
        self.check_fits(tenant, len(requests))
        headers: dict[str, str] = {}
        try:
            for request in requests:
                headers = dict(self.admit(tenant, request).headers)
            yield headers
        except BaseException:
            for request in requests:
                self.cancel(request.request_id)
            raise

    def check_fits(self, tenant: Tenant, num_requests: int) -> None:
        """A 400 for a request of more engine requests than the tenant may ever have in flight."""
        try:
            self.quotas.check_fits(tenant, num_requests)
        except QuotaExceeded as exc:
            raise _api_error(exc) from None

    @property
    def num_held(self) -> int:
        """Admissions whose quota is taken: requests between the gate and their end."""
        return len(self._held)

    def cancel(self, request_id: RequestId) -> None:
        """The engine refused the request after the gate let it in: give the quota back unused."""
        admission = self._held.pop(request_id, None)
        if admission is not None:
            self.quotas.release(admission, 0)

    def on_tokens(self, request: EngineRequest, event: TokenEvent, now: float) -> None:
        return None

    def on_finished(self, request: EngineRequest, event: TokenEvent, now: float) -> None:
        admission = self._held.pop(request.request_id, None)
        if admission is not None:
            self.quotas.release(admission, event.num_prompt_tokens + event.num_output_tokens)


def _api_error(exc: QuotaExceeded) -> APIError:
    error_type = RATE_LIMIT_ERROR if exc.status == 429 else "invalid_request_error"
    return APIError(exc.status, exc.message, type=error_type, code=exc.code, headers=exc.headers)
