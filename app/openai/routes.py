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

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.observability.process_stats import process_stats
from app.openai.answers import best_choices, with_tool_calls
from app.openai.lora_routes import LoraRoutes, adapter_card
from app.openai.objects import (
    DONE_EVENT,
    ChatChunks,
    Choice,
    ChunkEncoder,
    CompletionChunks,
    EchoedPrompt,
    Envelope,
    LogprobsFormat,
    StreamShape,
    chat_completion,
    sse_error_event,
    text_completion,
)
from app.plumbing.asgi import EventStreamResponse
from app.plumbing.errors import APIError, json_response
from app.serving.adapters import adapter_of
from app.serving.bodies import parsed_body, validated
from app.serving.context import ServingContext
from app.serving.generation import GenerationFailed, TextPiece
from app.serving.items import RetryLater
from app.serving.off_loop import THREAD_ITEMS, THREAD_TOKENIZE_CHARS
from app.serving.schemas import ChatCompletionBody, CompletionBody, GenerationBody
from app.serving.submission import (
    NO_PIN,
    RETRY_AFTER_S,
    CachePin,
    ChoiceStarter,
    Generations,
    shutting_down,
)
from app.serving.tools import ToolStream, tool_finish_reason, uses_tools
from contract.plan import TokenLogprobs
from scheduling.request import PriorityClass
from tenancy.tenants import Tenant

BodyT = TypeVar("BodyT", bound=GenerationBody)
CHAT_PATH = "/v1/chat/completions"


@dataclass(slots=True, frozen=True)
class Flavor:
    """What differs between /v1/chat/completions and /v1/completions."""

    id_prefix: str
    prompt_param: str
    chunks: type[ChatChunks] | type[CompletionChunks]
    whole: Callable[..., dict[str, Any]]


CHAT = Flavor("chatcmpl-", "messages", ChatChunks, chat_completion)
COMPLETION = Flavor("cmpl-", "prompt", CompletionChunks, text_completion)


class OpenAIRoutes:
    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.starter = ChoiceStarter(context)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.retrieve_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            *LoraRoutes(self.context).routes(),
        ]

    # ---- models, health, stats ------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        adapters = self.context.adapters.visible_to(tenant) if self.context.adapters is not None else []
        return json_response({"object": "list",
                              "data": [self._model_card(), *(adapter_card(self.context, a) for a in adapters)]})

    async def retrieve_model(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        model_id = request.path_params["model_id"]
        adapter = adapter_of(self.context.adapters, model_id, self.context.model_name, tenant)  # or the 404
        return json_response(self._model_card() if adapter is None else adapter_card(self.context, adapter))

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.context.model_name, "object": "model", "created": self.context.created,
                "owned_by": "fairlane", "root": self.context.settings.model, "parent": None,
                "max_model_len": self.context.geometry.max_model_len}

    async def health(self, request: Request) -> Response:
        """Ready (200) while the engine steps; 503 with the reason once it has failed or stalled (not
        live: restart me), or while shutting down (live, not ready: send traffic elsewhere)."""
        engine = self.context.engine.health()
        if not engine.is_healthy:
            return json_response({"status": "unhealthy", "live": False, "ready": False, "reason": engine.reason},
                                 503, headers={"retry-after": RETRY_AFTER_S})
        if self.context.is_draining:
            return json_response({"status": "draining", "live": True, "ready": False}, 503,
                                 headers={"retry-after": RETRY_AFTER_S})
        compiling = self.context.compile_status()  # ready all the same: steps run eagerly meanwhile
        return json_response({"status": "ok", "live": True, "ready": True,
                              **({} if compiling is None else {"compile": compiling})})

    async def stats(self, request: Request) -> Response:
        self.context.gate.authorize_operator(request)
        return json_response({**self.context.engine.stats(), "process": process_stats(),
                              "compile": self.context.compile_status()})

    # ---- generation -----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await self._parse(request, ChatCompletionBody, tenant)
        return await self._generate(request, tenant, body, await self._prompts_of(body, tenant), CHAT)

    async def completions(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await self._parse(request, CompletionBody, tenant)
        return await self._generate(request, tenant, body, await self._prompts_of(body, tenant), COMPLETION)

    async def _prompts_of(self, body: GenerationBody, tenant: Tenant) -> list[list[int]]:
        if isinstance(body, CompletionBody):
            return [await self._completion_prompt(prompt, tenant) for prompt in body.prompts]
        assert isinstance(body, ChatCompletionBody)
        return [await self.starter.chat_prompt(body, tenant)]

    async def _cache_pin(self, body: GenerationBody, prompts: list[list[int]], tenant: Tenant) -> CachePin:
        """A chat body's cache breakpoint (completions have none: they name no messages)."""
        if not isinstance(body, ChatCompletionBody):
            return NO_PIN
        return await self.starter.cache_pin(body, prompts[0], tenant)

    async def _completion_prompt(self, prompt: str | list[int], tenant: Tenant) -> list[int]:
        if isinstance(prompt, str):
            return await self.context.off_loop.run_if(len(prompt) >= THREAD_TOKENIZE_CHARS, tenant.tenant_id,
                                                      self.context.tokenizer.encode, prompt)
        vocab_size = self.context.tokenizer.vocab_size
        if any(token >= vocab_size for token in prompt):
            raise APIError(400, f"Token ids in the prompt must be below the vocabulary size {vocab_size}.",
                           param="prompt", code="invalid_value")
        return prompt

    async def _parse(self, request: Request, body_type: type[BodyT], tenant: Tenant) -> BodyT:
        if self.context.is_draining:
            raise shutting_down()
        return await parsed_body(self.context, request, tenant, body_type)

    async def _generate(self, request: Request, tenant: Tenant, body: GenerationBody, prompts: list[list[int]],
                        flavor: Flavor) -> Response:
        await self.starter.check_grammar(body, tenant)
        completion_id = flavor.id_prefix + uuid.uuid4().hex
        started = self.starter.start(completion_id, body, prompts, tenant, flavor.prompt_param,
                                     self._priority_of(body), await self._cache_pin(body, prompts, tenant))
        envelope = Envelope(completion_id, int(time.time()), body.model, body.service_tier)
        logprobs = self._logprobs_format(body)
        if body.is_stream:
            shape = StreamShape(body.include_usage, body.continuous_usage, logprobs)
            chunks = flavor.chunks(envelope, shape, started.choices.usage)
            return EventStreamResponse(self._sse_events(started, chunks, shape), started.headers)
        return await self.starter.whole_answer(request, self._whole(started, body, envelope, flavor), started.headers)

    async def _whole(self, started: Generations, body: GenerationBody, envelope: Envelope, flavor: Flavor
                     ) -> dict[str, Any]:
        results = await started.choices.collect_all()
        choices = [Choice(i, result, started.prefixes[i], self._echoed(started, i, result.prompt_logprobs))
                   for i, result in enumerate(results)]
        if body.num_generations > body.num_choices:  # best_of: keep the n likeliest of each prompt
            choices = best_choices(choices, body.num_generations, body.num_choices)
        if isinstance(body, ChatCompletionBody) and uses_tools(body):
            choices = [with_tool_calls(body, choice) for choice in choices]
        return flavor.whole(envelope, choices, started.choices.usage(), self._logprobs_format(body))

    @staticmethod
    def _echoed(started: Generations, index: int, prompt_logprobs: tuple[TokenLogprobs, ...]) -> EchoedPrompt | None:
        """The echoed prompt's log probabilities of a choice, when its request asked for them."""
        request = started.choices.generations[index].request
        if request.sampling.prompt_logprobs is None:
            return None
        return EchoedPrompt(request.prompt_token_ids[0], prompt_logprobs)

    def _logprobs_format(self, body: GenerationBody) -> LogprobsFormat | None:
        return LogprobsFormat(self.context.tokenizer) if body.num_logprobs is not None else None

    async def run_batch_item(self, tenant_id: str, url: str, raw_body: dict[str, Any]
                             ) -> tuple[int, str, dict[str, Any]]:
        """One Batch API item, run as its endpoint runs a request without streaming, in the batch
        class under the batch's tenant, charged to its quotas like any request. Returns (status,
        request id, response body). Raises RetryLater when it cannot run now (the tenant's
        tokens_per_minute or concurrency spent, the server overloaded or draining): it stays pending."""
        flavor, body_type = (CHAT, ChatCompletionBody) if url == CHAT_PATH else (COMPLETION, CompletionBody)
        completion_id = flavor.id_prefix + uuid.uuid4().hex
        tenant = self.context.engine.tenants.get(tenant_id)
        try:
            body: GenerationBody = await self.context.off_loop.run_if(
                _has_many_items(raw_body), tenant_id, validated, body_type, {**raw_body, "stream": False})
            self.context.check_model(body.model, tenant)
            await self.starter.check_grammar(body, tenant)
            prompts = await self._prompts_of(body, tenant)
            started = self.starter.start(completion_id, body, prompts, tenant, flavor.prompt_param,
                                         PriorityClass.BATCH, await self._cache_pin(body, prompts, tenant))
            envelope = Envelope(completion_id, int(time.time()), body.model, body.service_tier)
            return 200, completion_id, await self._whole(started, body, envelope, flavor)
        except GenerationFailed as exc:
            if self.context.is_draining or exc.status == 503:
                raise RetryLater(str(exc)) from None
            return 500, completion_id, self.starter.failure(exc).body()
        except APIError as exc:
            if exc.status in (429, 503):  # the tenant's quota or the server is full for now: wait, not fail
                raise RetryLater(exc.message) from None
            return exc.status, completion_id, exc.body()

    @staticmethod
    def _priority_of(body: GenerationBody) -> PriorityClass:
        return PriorityClass.BATCH if body.is_batch_class else PriorityClass.INTERACTIVE

    async def _sse_events(self, started: Generations, chunks: ChunkEncoder, shape: StreamShape
                          ) -> AsyncGenerator[bytes, None]:
        # An echoed prompt with log probabilities waits for them: they come with the first token.
        waiting_echoes: dict[int, str] = {}
        for index, prefix in enumerate(started.prefixes):
            opening = chunks.opening(index)
            if opening is not None:
                yield opening
            if prefix and started.choices.generations[index].request.sampling.prompt_logprobs is not None:
                waiting_echoes[index] = prefix
            elif prefix:
                yield chunks.content(index, prefix)
        try:
            async with aclosing(started.choices.interleaved()) as pieces:
                async for index, piece in pieces:
                    if index in waiting_echoes:
                        yield chunks.content(index, waiting_echoes.pop(index),
                                             echoed=self._echoed(started, index, piece.prompt_logprobs))
                    if started.tool_streams is not None:
                        for event in tool_stream_events(chunks, started.tool_streams[index], index, piece):
                            yield event
                        continue
                    if piece.text or piece.logprobs:
                        yield chunks.content(index, piece.text, piece.logprobs)
                    if piece.finish_reason is not None:
                        yield chunks.finish(index, piece.finish_reason)
            if shape.include_usage:
                yield chunks.usage(started.choices.usage())
        except GenerationFailed as exc:
            error = self.starter.failure(exc)
            yield sse_error_event(error.message, error.type, error.code)
        yield DONE_EVENT


def tool_stream_events(chunks: ChunkEncoder, tools: ToolStream, index: int, piece: TextPiece) -> list[bytes]:
    """The chunks of one piece of a choice whose output may hold tool calls."""
    content, deltas = tools.take(piece.text, is_last=piece.finish_reason is not None)
    events = [chunks.content(index, content, piece.logprobs)] if content or piece.logprobs else []
    if deltas:
        events.append(chunks.tool_calls(index, deltas))
    if piece.finish_reason is not None:
        events.append(chunks.finish(index, tool_finish_reason(piece.finish_reason, tools.has_calls)))
    return events


def _has_many_items(raw_body: dict[str, Any]) -> bool:
    """Whether a batch line is worth validating in a worker thread: many messages or prompts."""
    items = raw_body.get("messages") or raw_body.get("prompt")
    return isinstance(items, list) and len(items) > THREAD_ITEMS
