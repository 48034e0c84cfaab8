"""The OpenAI-compatible endpoints, plus /health and /stats.

A generation request goes: refuse if draining -> read the body (bounded) -> validate -> check the
model -> tokenize -> submit to the engine -> stream SSE chunks, or wait for the whole answer while
watching for the client to leave.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.asgi import ClientGone, EventStreamResponse, read_body, unless_disconnected
from app.batch.runner import RetryLater
from app.context import ServingContext
from app.errors import SERVER_ERROR, APIError, from_validation_error, json_response
from app.generation import GenerationFailed, TextGeneration, TextPiece, Usage, collect
from app.responses import (
    DONE_EVENT,
    ChatChunks,
    ChunkEncoder,
    CompletionChunks,
    Envelope,
    chat_completion,
    sse_error_event,
    text_completion,
)
from app.schemas import ChatCompletionBody, CompletionBody, GenerationBody
from gpu.plan import SamplingParams
from scheduling.engine import EngineOverloaded, EngineStopped, RequestStream
from scheduling.request import PriorityClass, RequestId
from scheduling.request import Request as EngineRequest
from scheduling.scheduler import AdmissionError
from tenancy.tenants import Tenant

BodyT = TypeVar("BodyT", bound=GenerationBody)
RETRY_AFTER_S = "1"
SHUTTING_DOWN = "The server is shutting down; retry on another replica or later."
# Tokenizing a long prompt can take long enough to stall every stream; such prompts go to a thread.
THREAD_TOKENIZE_CHARS = 16_384
# Below this temperature sampling is greedy: logits / temperature would overflow float32 near 0.
GREEDY_BELOW_TEMPERATURE = 1e-5
# What a client that disconnects is "answered" (it is never seen): nginx's "client closed request".
CLIENT_CLOSED_STATUS = 499
CHAT_PATH = "/v1/chat/completions"


@dataclass(slots=True, frozen=True)
class Flavor:
    """What differs between /v1/chat/completions and /v1/completions."""

    id_prefix: str
    prompt_param: str
    chunks: Callable[[Envelope, bool], ChunkEncoder]
    whole: Callable[[Envelope, TextPiece, Usage], dict[str, Any]]


CHAT = Flavor("chatcmpl-", "messages", ChatChunks, chat_completion)
COMPLETION = Flavor("cmpl-", "prompt", CompletionChunks, text_completion)


class OpenAIRoutes:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.retrieve_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
        ]

    # ---- models, health, stats ------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        self.context.gate.authenticate(request)
        return json_response({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        self.context.gate.authenticate(request)
        model_id = request.path_params["model_id"]
        if model_id != self.context.model_name:
            raise self._unknown_model(model_id)
        return json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.context.model_name, "object": "model", "created": self.context.created,
                "owned_by": "fairlane"}

    async def health(self, request: Request) -> Response:
        """Alive whenever it answers; ready (200) until shutdown starts, then 503 for load balancers."""
        if self.context.is_draining:
            return json_response({"status": "draining", "live": True, "ready": False}, 503)
        return json_response({"status": "ok", "live": True, "ready": True})

    async def stats(self, request: Request) -> Response:
        return json_response(self.context.engine.stats())

    # ---- generation -----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await self._parse(request, ChatCompletionBody)
        return await self._generate(request, tenant, body, await self._prompt_of(body), CHAT)

    async def completions(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await self._parse(request, CompletionBody)
        return await self._generate(request, tenant, body, await self._prompt_of(body), COMPLETION)

    async def _prompt_of(self, body: GenerationBody) -> list[int]:
        if isinstance(body, CompletionBody):
            text = body.prompt_text
            return await self._tokenize(self.context.tokenizer.encode, text, len(text))
        assert isinstance(body, ChatCompletionBody)
        messages = [{"role": message.role, "content": message.text} for message in body.messages]
        num_chars = sum(len(message["content"]) for message in messages)
        try:
            return await self._tokenize(self.context.tokenizer.encode_chat, messages, num_chars)
        except Exception as exc:  # chat templates raise what they like (e.g. roles that must alternate)
            raise APIError(400, f"The model's chat template cannot render these messages: {exc}",
                           param="messages") from None

    async def _parse(self, request: Request, body_type: type[BodyT]) -> BodyT:
        if self.context.is_draining:
            raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
        raw = await read_body(request, self.context.settings.max_body_bytes)
        try:
            body = body_type.model_validate_json(raw)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        return self._served_model(body)

    def _served_model(self, body: BodyT) -> BodyT:
        if body.model != self.context.model_name:
            raise self._unknown_model(body.model)
        return body

    def _unknown_model(self, model: str) -> APIError:
        return APIError(404, f"The model '{model}' does not exist; this server serves "
                             f"'{self.context.model_name}'.", param="model", code="model_not_found")

    @staticmethod
    async def _tokenize(encode: Callable[[Any], list[int]], text: Any, num_chars: int) -> list[int]:
        if num_chars < THREAD_TOKENIZE_CHARS:
            return encode(text)
        return await run_in_threadpool(encode, text)

    async def _generate(self, request: Request, tenant: Tenant, body: GenerationBody, prompt: list[int],
                        flavor: Flavor) -> Response:
        if not prompt:
            raise APIError(400, "The prompt is empty once tokenized.", param=flavor.prompt_param)
        completion_id = flavor.id_prefix + uuid.uuid4().hex
        engine_request = self._engine_request(completion_id, body, prompt, tenant)
        self.context.gate.check_class(tenant, engine_request.priority)
        headers = self.context.gate.admit(tenant, engine_request).headers
        stream = self._submit(engine_request, body, flavor)
        generation = TextGeneration(stream, self.context.tokenizer, body.stop_strings,
                                    coalesce=self.context.settings.stream_coalesce)
        envelope = Envelope(completion_id, int(time.time()), self.context.model_name, body.service_tier)
        if body.is_stream:
            chunks = flavor.chunks(envelope, body.include_usage)
            return EventStreamResponse(self._sse_events(generation, chunks, body.include_usage), headers)
        try:
            result = await unless_disconnected(request.receive, collect(generation))
        except GenerationFailed as exc:
            raise self._failure(str(exc)) from None
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return json_response(flavor.whole(envelope, result, generation.usage), headers=headers)

    async def run_batch_item(self, tenant_id: str, url: str, raw_body: dict[str, Any]
                             ) -> tuple[int, str, dict[str, Any]]:
        """One Batch API item, run as its endpoint runs a request without streaming, in the batch
        class under the batch's tenant. Returns (status, request id, response body). Raises RetryLater
        when the server cannot take it now (overloaded or draining): it stays pending."""
        flavor, body_type = (CHAT, ChatCompletionBody) if url == CHAT_PATH else (COMPLETION, CompletionBody)
        completion_id = flavor.id_prefix + uuid.uuid4().hex
        tenant = self.context.engine.scheduler.tenants.get(tenant_id)
        try:
            body = self._served_model(body_type.model_validate({**raw_body, "stream": False}))
            prompt = await self._prompt_of(body)
            if not prompt:
                raise APIError(400, "The prompt is empty once tokenized.", param=flavor.prompt_param)
            engine_request = self._engine_request(completion_id, body, prompt, tenant, PriorityClass.BATCH)
            generation = TextGeneration(self._submit(engine_request, body, flavor), self.context.tokenizer,
                                        body.stop_strings)
            result = await collect(generation)
        except ValidationError as exc:
            return 400, completion_id, from_validation_error(exc).body()
        except GenerationFailed as exc:
            if self.context.is_draining:
                raise RetryLater(str(exc)) from None
            return 500, completion_id, self._failure(str(exc)).body()
        except APIError as exc:
            if exc.status == 503:
                raise RetryLater(exc.message) from None
            return exc.status, completion_id, exc.body()
        envelope = Envelope(completion_id, int(time.time()), self.context.model_name, body.service_tier)
        return 200, completion_id, flavor.whole(envelope, result, generation.usage)

    def _engine_request(self, request_id: str, body: GenerationBody, prompt: list[int], tenant: Tenant,
                        priority: PriorityClass | None = None) -> EngineRequest:
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        sampling = SamplingParams(temperature, top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
        return EngineRequest(RequestId(request_id), prompt, self._max_tokens(body, len(prompt)), sampling,
                             stop_token_ids=frozenset() if body.ignore_eos else self.context.tokenizer.eos_token_ids,
                             tenant_id=tenant.tenant_id, priority=priority or self._priority_of(body),
                             cache_salt=tenant.cache_salt + (f"|request:{body.cache_salt}" if body.cache_salt else ""))

    @staticmethod
    def _priority_of(body: GenerationBody) -> PriorityClass:
        return PriorityClass.BATCH if body.is_batch_class else PriorityClass.INTERACTIVE

    def _max_tokens(self, body: GenerationBody, num_prompt_tokens: int) -> int:
        """The request's own if it gives one; else the rest of the context, capped at
        settings.default_max_tokens. A request that does not fit is refused by the engine's
        admission check, with the numbers."""
        if body.requested_max_tokens is not None:
            return body.requested_max_tokens
        room = self.context.geometry.max_model_len - num_prompt_tokens
        return max(1, min(self.context.settings.default_max_tokens, room))

    def _submit(self, engine_request: EngineRequest, body: GenerationBody, flavor: Flavor) -> RequestStream:
        """Hand the request to the engine; if it refuses, the quota taken at the gate goes back."""
        try:
            return self._submit_or_explain(engine_request, body, flavor)
        except APIError:
            self.context.gate.cancel(engine_request.request_id)
            raise

    def _submit_or_explain(self, engine_request: EngineRequest, body: GenerationBody, flavor: Flavor
                           ) -> RequestStream:
        try:
            return self.context.engine.submit(engine_request)
        except AdmissionError as exc:
            param = "max_tokens" if body.requested_max_tokens is not None else flavor.prompt_param
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except EngineOverloaded as exc:
            raise APIError(503, f"The server is overloaded ({exc}); retry shortly.", code="server_overloaded",
                           headers={"retry-after": RETRY_AFTER_S}) from None
        except EngineStopped:
            raise APIError(503, SHUTTING_DOWN, code="server_shutting_down") from None

    def _failure(self, message: str) -> APIError:
        """A request the engine ended with an error: a 503 while draining, else the server's fault."""
        if self.context.is_draining:
            return APIError(503, SHUTTING_DOWN, code="server_shutting_down")
        return APIError(500, message, type=SERVER_ERROR)

    async def _sse_events(self, generation: TextGeneration, chunks: ChunkEncoder, include_usage: bool
                          ) -> AsyncGenerator[bytes, None]:
        opening = chunks.opening()
        if opening is not None:
            yield opening
        try:
            async with aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    if piece.text:
                        yield chunks.content(piece.text)
                    if piece.finish_reason is not None:
                        yield chunks.finish(piece.finish_reason)
            if include_usage:
                yield chunks.usage(generation.usage)
        except GenerationFailed as exc:
            error = self._failure(str(exc))
            yield sse_error_event(error.message, error.type, error.code)
        yield DONE_EVENT
