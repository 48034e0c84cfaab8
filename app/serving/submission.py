"""Starting a response's choices: build each choice's engine request, take the tenant's quota for
all of them or none, submit the first choice of each prompt and defer the others (app/serving/choices.py).
Every refusal on the way is an APIError, and nothing stays taken after one.

A chat body's explicit cache breakpoint (`cache_control`, see `ChatCompletionBody.cache_breakpoint`)
becomes each engine request's `cache_pin_tokens`: the leading tokens of the prompt that the chat
template renders for the messages through the marked one. The template is given that prefix alone;
as it always opens the assistant's turn after it, the pin is the longest common prefix of that
rendering and the whole prompt: exactly the tokens the two share, which is what the cache can keep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.plumbing.asgi import CLIENT_CLOSED_STATUS, ClientGone, unless_disconnected
from app.plumbing.errors import SERVER_ERROR, APIError, json_response
from app.serving.adapters import adapter_of
from app.serving.admission import RATE_LIMIT_ERROR
from app.serving.choices import ChoiceSet, DeferredStream
from app.serving.context import ServingContext
from app.serving.generation import GenerationFailed, TextGeneration, TokenStream
from app.serving.off_loop import THREAD_ITEMS, THREAD_TOKENIZE_CHARS
from app.serving.sampling import sampling_params, structured_from_response_format, structured_output_of
from app.serving.schemas import CacheControl, ChatCompletionBody, CompletionBody, GenerationBody
from app.serving.tools import ToolStream, template_messages, template_tools, uses_tools
from scheduling.engine import EngineOverloaded, EngineStopped, RequestStream, TenantOverShare
from scheduling.request import PriorityClass, RequestId
from scheduling.request import Request as EngineRequest
from scheduling.scheduler import AdmissionError
from tenancy.tenants import Tenant

RETRY_AFTER_S = "1"
SHUTTING_DOWN = "The server is shutting down; retry on another replica or later."


def shutting_down() -> APIError:
    return APIError(503, SHUTTING_DOWN, code="server_shutting_down", headers={"retry-after": RETRY_AFTER_S})


@dataclass(slots=True, frozen=True)
class CachePin:
    """A prompt's explicit cache breakpoint, as the engine request carries it."""

    num_tokens: int = 0  # the prompt's leading tokens to keep; 0: no breakpoint
    ttl_s: float = 0.0  # kept this long after the last request that uses them


NO_PIN = CachePin()


@dataclass(slots=True)
class Generations:
    """One response's choices, started, and what the reply needs besides them."""

    choices: ChoiceSet
    headers: dict[str, str]
    prefixes: list[str]  # per choice: the echoed prompt of a completion, else ""
    tool_streams: list[ToolStream] | None = None  # per choice, when a chat request uses tools
    # The prompt tokens its breakpoint can keep: the full blocks before it, never the block of the last
    # prompt token (always computed). 0 without a breakpoint or a prefix cache. Messages API usage
    # reports what of these was not read from the cache as written to it.
    num_pinnable_tokens: int = 0


class ChoiceStarter:
    """What every API that generates shares, from a chat body to started choices and back to an
    error: chat completions, completions, the Responses API and the Messages API."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def chat_prompt(self, chat: ChatCompletionBody, tenant: Tenant, param: str = "messages") -> list[int]:
        """The chat template's prompt for the body; long ones are rendered off the event loop. A
        conversation the template refuses is a 400 naming `param`, the field it came from."""
        try:
            return await self._render(chat, tenant)
        except Exception as exc:  # chat templates raise what they like (e.g. roles that must alternate)
            raise APIError(400, f"The model's chat template cannot render these messages: {exc}",
                           param=param) from None

    async def cache_pin(self, chat: ChatCompletionBody, prompt: list[int], tenant: Tenant) -> CachePin:
        """The breakpoint of a chat body's `cache_control` marks (see the module's docstring), for its
        template's `prompt`; NO_PIN without one. A prefix the template refuses to render alone (one
        that must end on a user's turn, say) is no breakpoint: the request is served without a pin."""
        marked = await self.context.off_loop.run_if(len(chat.messages) > THREAD_ITEMS, tenant.tenant_id,
                                                    _cache_breakpoint, chat)
        if marked is None:
            return NO_PIN
        index, control = marked
        if index == len(chat.messages) - 1:  # the whole conversation: the prefix is the prompt
            return CachePin(len(prompt), control.ttl_s)
        prefix = chat.model_copy(update={"messages": chat.messages[:index + 1]})
        try:
            rendered = await self._render(prefix, tenant)
        except Exception:  # as chat_prompt's: whatever the template raises
            return NO_PIN
        return CachePin(_common_prefix_length(rendered, prompt), control.ttl_s)

    async def _render(self, chat: ChatCompletionBody, tenant: Tenant) -> list[int]:
        return await self.context.off_loop.run_if(is_heavy_chat(chat), tenant.tenant_id, self.render, chat)

    def render(self, chat: ChatCompletionBody) -> list[int]:
        """The chat template's prompt for the body, here and now (raises what the template raises)."""
        tokenizer = self.context.tokenizer
        messages = template_messages(chat, tokenizer.knows_tools)
        tools = template_tools(chat) if tokenizer.knows_tools else None
        return tokenizer.encode_chat(messages, tools)

    async def check_grammar(self, body: GenerationBody, tenant: Tenant, format_param: str = "response_format"
                            ) -> None:
        """A 400 for a schema (of the output format, named `format_param` in the caller's API, or of a
        forced tool call) the grammar engine cannot compile, before anything is submitted. Off the
        event loop: the first one reads the tokenizer."""
        structured = structured_output_of(body, tenant.cache_salt_for())
        if structured is None:
            return
        try:
            await self.context.off_loop.run_if(True, tenant.tenant_id, self.context.engine.executor.check_structured,
                                               structured)
        except ValueError as exc:
            param = format_param if structured_from_response_format(body) else "tools"
            raise APIError(400, f"The schema cannot be used to constrain the output: {exc}", param=param,
                           code="invalid_schema") from None

    async def whole_answer(self, request: Request, whole: Coroutine[Any, Any, dict[str, Any]],
                           headers: Mapping[str, str]) -> Response:
        """A response that is not streamed: `whole` (the surface's answer object) as JSON once the
        generation ends; a generation that failed, the error it ended with; a client that left
        first, 499 (nobody sees it; the generation was aborted by `whole`'s cleanup)."""
        try:
            answer = await unless_disconnected(request.receive, whole)
        except GenerationFailed as exc:
            raise self.failure(exc) from None
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return json_response(answer, headers=headers)

    def failure(self, exc: GenerationFailed) -> APIError:
        """A request the engine ended with an error: a 503 while draining or overloaded, else the
        server's fault."""
        if self.context.is_draining:
            return shutting_down()
        if exc.status == 503:
            return APIError(503, str(exc), code="server_overloaded", headers={"retry-after": RETRY_AFTER_S})
        return APIError(500, str(exc), type=SERVER_ERROR)

    def start(self, completion_id: str, body: GenerationBody, prompts: list[list[int]], tenant: Tenant,
              prompt_param: str, priority: PriorityClass, cache_pin: CachePin = NO_PIN) -> Generations:
        """Build, admit and submit every choice's engine request; on any refusal nothing stays taken.
        `cache_pin` (from `cache_pin()`) is set on every one of them."""
        if any(not prompt for prompt in prompts):
            raise APIError(400, "The prompt is empty once tokenized.", param=prompt_param)
        requests = self._engine_requests(completion_id, body, prompts, tenant, priority, cache_pin)
        self.context.gate.check_class(tenant, priority)
        with self.context.gate.holding(tenant, requests) as headers:
            choices = self._submit_all(requests, body, prompt_param)
            try:
                tool_streams = [ToolStream(body) for _ in requests] \
                    if isinstance(body, ChatCompletionBody) and uses_tools(body) else None
                return Generations(choices, headers, self._echoed_prefixes(body, prompts), tool_streams,
                                   self._pinnable_tokens(cache_pin, prompts))
            except BaseException:
                for generation in choices.generations:  # the engine requests end; the deferred ones never start
                    generation.close()
                raise

    def _pinnable_tokens(self, cache_pin: CachePin, prompts: list[list[int]]) -> int:
        """What the prefix cache can keep of the breakpoint: whole blocks, short of the last prompt token's
        (see KVBlockManager.pin_breakpoint and cached_prefix)."""
        if not cache_pin.num_tokens or not self.context.settings.enable_prefix_caching:
            return 0
        block_size = self.context.geometry.block_size
        num_prompt_tokens = min(len(prompt) for prompt in prompts)
        return min(cache_pin.num_tokens // block_size, (num_prompt_tokens - 1) // block_size) * block_size

    def _engine_requests(self, completion_id: str, body: GenerationBody, prompts: list[list[int]],
                         tenant: Tenant, priority: PriorityClass, cache_pin: CachePin) -> list[EngineRequest]:
        sampling = sampling_params(body, self.context.tokenizer, tenant.cache_salt_for())
        stop_token_ids = self._stop_token_ids(body)
        if sampling.min_tokens:
            sampling = replace(sampling, min_tokens_banned=tuple(sorted(stop_token_ids)))
        adapter = adapter_of(self.context.adapters, body.model, self.context.model_name, tenant)
        salt = tenant.cache_salt_for(body.cache_salt, None if adapter is None else adapter.cache_key)
        per_prompt = body.num_generations
        deadline = self._ttft_deadline(body, tenant, priority)
        itl_target_ms = tenant.limits.itl_target_ms if priority is PriorityClass.INTERACTIVE else None
        itl_target_s = None if itl_target_ms is None else itl_target_ms / 1000
        requests = []
        for index in range(len(prompts) * per_prompt):
            prompt = prompts[index // per_prompt]
            request_id = completion_id if len(prompts) * per_prompt == 1 else f"{completion_id}-{index}"
            # Like vLLM: the choices of a seeded request draw from seed, seed + 1, ... so they differ.
            seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index % per_prompt)
            requests.append(EngineRequest(RequestId(request_id), prompt, self._max_tokens(body, len(prompt)), seeded,
                                          stop_token_ids=stop_token_ids, tenant_id=tenant.tenant_id,
                                          priority=priority, cache_salt=salt, adapter=adapter,
                                          cache_pin_tokens=cache_pin.num_tokens, cache_pin_ttl_s=cache_pin.ttl_s,
                                          ttft_deadline=deadline, itl_target_s=itl_target_s,
                                          stream_interval=self._stream_interval(body, priority)))
        return requests

    def _stream_interval(self, body: GenerationBody, priority: PriorityClass) -> int:
        """Tokens the request's stream sends at once (config/settings.py, stream_interval): 1 for a request with
        stop strings, which the API layer checks, so that no token past its stop is computed."""
        if body.stop_strings:
            return 1
        settings = self.context.settings
        return settings.batch_stream_interval if priority is PriorityClass.BATCH else settings.stream_interval

    @staticmethod
    def _ttft_deadline(body: GenerationBody, tenant: Tenant, priority: PriorityClass) -> float | None:
        """When the first token is due: the request's own deadline, else its tenant's TTFT target for an
        interactive request (on the engine's clock, time.monotonic)."""
        deadline_ms = body.ttft_deadline_ms
        if deadline_ms is None and priority is PriorityClass.INTERACTIVE:
            deadline_ms = tenant.limits.ttft_target_ms
        return None if deadline_ms is None else time.monotonic() + deadline_ms / 1000

    def _stop_token_ids(self, body: GenerationBody) -> frozenset[int]:
        requested = frozenset(body.stop_token_ids or ())
        vocab_size = self.context.tokenizer.vocab_size
        if any(token >= vocab_size for token in requested):
            raise APIError(400, f"stop_token_ids must be below the vocabulary size {vocab_size}.",
                           param="stop_token_ids", code="invalid_value")
        return requested if body.ignore_eos else requested | self.context.tokenizer.eos_token_ids

    def _submit_all(self, requests: list[EngineRequest], body: GenerationBody, prompt_param: str) -> ChoiceSet:
        """Submit the first choice of each prompt now; the others wait for its first token (see
        app/serving/choices.py). If the engine refuses one now, the started ones are aborted (the quotas go
        back with the gate's `holding`)."""
        per_prompt = body.num_generations
        generations: list[TextGeneration] = []
        try:
            for index, engine_request in enumerate(requests):
                stream: TokenStream
                if index % per_prompt == 0:
                    stream = self._submit(engine_request, body, prompt_param)
                else:
                    stream = self._deferred(engine_request, body, prompt_param, generations[index - index % per_prompt])
                generations.append(TextGeneration(stream, self.context.tokenizer, body.stop_strings,
                                                  coalesce=self.context.settings.stream_coalesce))
        except BaseException:
            for generation in generations:
                generation.close()
            raise
        return ChoiceSet(generations, list(range(0, len(requests), per_prompt)))

    def _deferred(self, engine_request: EngineRequest, body: GenerationBody, prompt_param: str,
                  first: TextGeneration) -> DeferredStream:
        def submit(later: EngineRequest) -> RequestStream:
            try:
                return self._submit(later, body, prompt_param)
            except APIError as exc:  # after start() returned: the gate's holding is over
                self.context.gate.cancel(later.request_id)
                raise GenerationFailed(exc.message, exc.status) from None

        # Without a prefix cache there is nothing to wait for: the prompt is computed again anyway.
        after = first.started if self.context.settings.enable_prefix_caching else _already_set()
        return DeferredStream(engine_request, submit, after,
                              lambda: self.context.gate.cancel(engine_request.request_id))

    def _echoed_prefixes(self, body: GenerationBody, prompts: list[list[int]]) -> list[str]:
        per_prompt = body.num_generations
        if not (isinstance(body, CompletionBody) and body.echo):
            return [""] * (len(prompts) * per_prompt)
        texts = [p if isinstance(p, str) else self.context.tokenizer.decode(p) for p in body.prompts]
        return [texts[index // per_prompt] for index in range(len(prompts) * per_prompt)]

    def _max_tokens(self, body: GenerationBody, num_prompt_tokens: int) -> int:
        """The request's own if it gives one; else the rest of the context, capped at
        settings.default_max_tokens. A request that does not fit is refused by the engine's
        admission check, with the numbers."""
        if body.requested_max_tokens is not None:
            return body.requested_max_tokens
        room = self.context.geometry.max_model_len - num_prompt_tokens
        return max(1, min(self.context.settings.default_max_tokens, room))

    def _submit(self, engine_request: EngineRequest, body: GenerationBody, prompt_param: str
                           ) -> RequestStream:
        try:
            return self.context.engine.submit(engine_request)
        except AdmissionError as exc:
            param = "max_tokens" if body.requested_max_tokens is not None else prompt_param
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except TenantOverShare as exc:
            raise APIError(429, f"Too many requests from this API key while the server is full ({exc}); "
                                "retry shortly.", type=RATE_LIMIT_ERROR, code="queue_share_exceeded",
                           headers={"retry-after": RETRY_AFTER_S}) from None
        except EngineOverloaded as exc:
            raise APIError(503, f"The server is overloaded ({exc}); retry shortly.", code="server_overloaded",
                           headers={"retry-after": RETRY_AFTER_S}) from None
        except EngineStopped as exc:
            if self.context.engine.failure is not None:
                raise APIError(503, f"The server cannot serve requests: {exc}.", code="engine_failed",
                               headers={"retry-after": RETRY_AFTER_S}) from None
            raise shutting_down() from None


def _cache_breakpoint(chat: ChatCompletionBody) -> tuple[int, CacheControl] | None:
    return chat.cache_breakpoint


def is_heavy_chat(chat: ChatCompletionBody) -> bool:
    """Whether rendering the conversation is worth a worker thread: many messages, or long ones."""
    if len(chat.messages) > THREAD_ITEMS:
        return True
    return sum(len(message.text) for message in chat.messages) >= THREAD_TOKENIZE_CHARS


def _common_prefix_length(first: list[int], second: list[int]) -> int:
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return min(len(first), len(second))


def _already_set() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event
