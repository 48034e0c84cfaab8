"""vLLM's operator endpoints for LoRA adapters: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`,
with `lora_name` and `lora_path`, guarded as /stats is (the admin key where a tenants file is set)."""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from app.plumbing.asgi import read_body
from app.plumbing.errors import APIError
from app.serving.adapters import AdapterRegistry
from app.serving.context import ServingContext
from contract.plan import LoraRef
from gpu.lora import AdapterError


def adapter_card(context: ServingContext, adapter: LoraRef) -> dict[str, Any]:
    """An adapter as /v1/models lists it, as vLLM does: its folder as root, the base model as parent."""
    return {"id": adapter.name, "object": "model", "created": context.created, "owned_by": "fairlane",
            "root": adapter.path, "parent": context.model_name, "max_model_len": context.geometry.max_model_len}


class LoraRoutes:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])]

    async def load_lora_adapter(self, request: Request) -> Response:
        """Serve the folder `lora_path` under `lora_name`: read and checked first, so a bad folder is a 400
        naming its file and changes nothing served. A name already served is replaced (a new version), for the
        same tenants."""
        registry = self._registry(request)
        name, path = await self._fields(request, need_path=True)
        try:
            await run_in_threadpool(registry.reload, name, path)
        except (AdapterError, ValueError) as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """New requests for the name get 404 at once; the requests already running on it finish."""
        registry = self._registry(request)
        name, _ = await self._fields(request, need_path=False)
        if not registry.unload(name):
            raise APIError(404, f"The LoRA adapter '{name}' is not loaded.", param="lora_name",
                           code="lora_adapter_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _registry(self, request: Request) -> AdapterRegistry:
        self.context.gate.authorize_operator(request)
        if self.context.adapters is None:
            raise APIError(400, "This server serves no LoRA adapters: start it with --enable-lora.",
                           code="lora_not_enabled")
        return self.context.adapters

    async def _fields(self, request: Request, *, need_path: bool) -> tuple[str, str]:
        raw = await read_body(request, self.context.settings.max_body_bytes)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise APIError(400, "The body must be a JSON object with 'lora_name' and 'lora_path'.")
        for param in ("lora_name", "lora_path") if need_path else ("lora_name",):
            if not isinstance(body.get(param), str) or not body[param]:
                raise APIError(400, f"'{param}' must be a non-empty string.", param=param)
        return str(body["lora_name"]), str(body.get("lora_path", ""))
