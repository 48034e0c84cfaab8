"""vLLM's /tokenize and /detokenize: what the server would feed the model, and the text of tokens."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.plumbing.asgi import read_body
from app.plumbing.errors import APIError, from_validation_error, json_response
from app.serving.context import ServingContext
from app.serving.off_loop import THREAD_BODY_BYTES, THREAD_TOKENIZE_CHARS
from app.serving.schemas import DetokenizeBody, TokenizeBody
from tenancy.tenants import Tenant

BodyT = TypeVar("BodyT", bound=BaseModel)
THREAD_DECODE_TOKENS = 4096  # decoding fewer tokens than this stays on the loop: a thread hop costs more


def _text_size(body: TokenizeBody) -> int:
    if body.prompt is not None:
        return len(body.prompt)
    return sum(len(message.text or "") for message in body.messages or [])


class TokenizationRoutes:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        tenant, body = await self._parse(request, TokenizeBody)
        # A long text (4 MiB is a body this endpoint takes) encodes for seconds: in a worker thread, as a
        # chat prompt is, so that no other tenant's stream waits on the event loop meanwhile.
        off_loop = self.context.off_loop
        tokens = await off_loop.run_if(_text_size(body) >= THREAD_TOKENIZE_CHARS, tenant.tenant_id, self._encode,
                                       body)
        result: dict[str, Any] = {"count": len(tokens), "max_model_len": self.context.geometry.max_model_len,
                                  "tokens": tokens, "token_strs": None}
        if body.return_token_strs:
            result["token_strs"] = await off_loop.run_if(len(tokens) >= THREAD_DECODE_TOKENS, tenant.tenant_id,
                                                         self._token_strs, tokens)
        return json_response(result)

    def _token_strs(self, tokens: list[int]) -> list[str]:
        return [self.context.tokenizer.decode([token]) for token in tokens]

    async def detokenize(self, request: Request) -> Response:
        tenant, body = await self._parse(request, DetokenizeBody)
        vocab_size = self.context.tokenizer.vocab_size
        if any(token >= vocab_size for token in body.tokens):
            raise APIError(400, f"Token ids must be below the vocabulary size {vocab_size}.", param="tokens",
                           code="invalid_value")
        text = await self.context.off_loop.run_if(len(body.tokens) >= THREAD_DECODE_TOKENS, tenant.tenant_id,
                                                  self.context.tokenizer.decode, body.tokens)
        return json_response({"prompt": text})

    def _encode(self, body: TokenizeBody) -> list[int]:
        if body.prompt is not None:
            return self.context.tokenizer.encode(body.prompt)
        messages = [{"role": message.role, "content": message.text} for message in body.messages or []]
        try:
            return self.context.tokenizer.encode_chat(messages)
        except Exception as exc:  # chat templates raise what they like
            raise APIError(400, f"The model's chat template cannot render these messages: {exc}",
                           param="messages") from None

    async def _parse(self, request: Request, body_type: type[BodyT]) -> tuple[Tenant, BodyT]:
        tenant = self.context.gate.authenticate(request)
        raw = await read_body(request, self.context.settings.max_body_bytes)
        body = await self.context.off_loop.run_if(len(raw) >= THREAD_BODY_BYTES, tenant.tenant_id, _validated,
                                                  body_type, raw)
        model = getattr(body, "model", None)
        if model is not None and model != self.context.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.context.model_name}'.", param="model", code="model_not_found")
        return tenant, body


def _validated(body_type: type[BodyT], raw: bytes) -> BodyT:
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
