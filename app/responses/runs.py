"""Starting one response and finishing it, whole or as stream events.

Starting goes the chat completions way: the conversation (a previous response's, then this
request's items) becomes a chat body, the chat template renders it, the grammar engine checks any
schema, and `ChoiceStarter` admits the request at the tenant's gate and submits it to the engine.
From there the fair queues, preemption, the prefix cache and the metrics see an ordinary request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from app.batch.uploads import storage_errors
from app.plumbing.errors import APIError
from app.responses.events import ResponseEvents
from app.responses.objects import ResponseHead, finished
from app.responses.schemas import ResponsesBody
from app.responses.store import ResponseQuota, ResponseStore
from app.responses.translate import (
    RESPONSES_PARAM,
    Item,
    canonical_items,
    chat_body_of,
    new_id,
    output_items,
    parsed_items,
    turn_starts,
    without_oldest_turns,
)
from app.serving.context import ServingContext
from app.serving.generation import GenerationFailed, TextPiece
from app.serving.off_loop import THREAD_ITEMS
from app.serving.schemas import ChatCompletionBody
from app.serving.submission import ChoiceStarter, Generations
from app.serving.tools import ToolStream
from scheduling.request import PriorityClass
from tenancy.tenants import Tenant

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ResponseRun:
    """One response, started: who asked, what it answers, the chat body generating it, its choice."""

    head: ResponseHead
    tenant: Tenant
    chat_body: ChatCompletionBody
    started: Generations
    items: list[dict[str, Any]]  # the conversation's input items, canonical: what is stored with it

    @property
    def tool_stream(self) -> ToolStream | None:
        return self.started.tool_streams[0] if self.started.tool_streams else None


class ResponseRunner:
    def __init__(self, context: ServingContext, store: ResponseStore) -> None:
        self.context = context
        self.store = store
        self.starter = ChoiceStarter(context)

    # ---- starting -----------------------------------------------------------------------------

    async def start(self, tenant: Tenant, body: ResponsesBody) -> ResponseRun:
        """Admit and submit the response's generation, or raise the APIError to answer instead."""
        items = await self._conversation(tenant, body)
        return await self.start_conversation(tenant, ResponseHead(new_id("resp_"), body.model, body),
                                             items)

    async def start_conversation(self, tenant: Tenant, head: ResponseHead, items: list[dict[str, Any]]
                                 ) -> ResponseRun:
        """Start the response `head` to these conversation items (canonical): a new one, or a background
        one again after a restart."""
        body = head.body
        many = len(items) > THREAD_ITEMS
        chat_body = await self.context.off_loop.run_if(many, tenant.tenant_id, _translated, body, items)
        chat_body, prompt = await self._fitting_prompt(chat_body, body, tenant)
        await self.starter.check_grammar(chat_body, tenant, format_param="text.format")
        priority = PriorityClass.BATCH if body.is_background or chat_body.is_batch_class \
            else PriorityClass.INTERACTIVE
        try:
            started = self.starter.start(head.id, chat_body, [prompt], tenant, "input", priority)
        except APIError as exc:
            exc.param = _param_in_responses_terms(exc, body, chat_body)
            raise
        return ResponseRun(head, tenant, chat_body, started, items)

    async def _conversation(self, tenant: Tenant, body: ResponsesBody) -> list[dict[str, Any]]:
        """The previous response's conversation and output (its turns form the prompt's prefix, so
        the prefix cache finds them), then this request's items."""
        own: list[Item] = body.input_items
        own_items = await self.context.off_loop.run_if(len(own) > THREAD_ITEMS, tenant.tenant_id, canonical_items,
                                                       own)
        if body.previous_response_id is None:
            return own_items
        previous = await self.store.get(tenant.tenant_id, body.previous_response_id)
        if previous is None:
            raise APIError(404, f"No such response: '{body.previous_response_id}'.", param="previous_response_id",
                           code="not_found")
        if previous.response["status"] not in ("completed", "incomplete"):
            raise APIError(400, f"Response '{body.previous_response_id}' is {previous.response['status']}: only "
                                "a finished response can be continued.", param="previous_response_id")
        previous_output: list[dict[str, Any]] = previous.response["output"]
        return previous.items + previous_output + own_items

    async def _fitting_prompt(self, chat_body: ChatCompletionBody, body: ResponsesBody, tenant: Tenant
                              ) -> tuple[ChatCompletionBody, list[int]]:
        """The prompt; with `truncation: auto`, the fewest oldest turns are dropped that leave room for
        the output, or all but the last (with `disabled`, or if even the last turn is too long, the
        engine refuses the prompt with the numbers)."""
        prompt = await self.starter.chat_prompt(chat_body, tenant, param="input")
        if body.truncation != "auto" or not self._is_too_long(chat_body, prompt):
            return chat_body, prompt
        return await self._shortest_fitting(chat_body, tenant)

    async def _shortest_fitting(self, chat_body: ChatCompletionBody, tenant: Tenant
                                ) -> tuple[ChatCompletionBody, list[int]]:
        """The conversation less the fewest oldest turns that fits, found by halving: a few renders
        however many turns there are, where dropping one turn at a time rendered the whole history
        once per dropped turn. A prompt shortens as turns go (each turn adds its own tokens)."""
        starts = turn_starts(chat_body)
        if len(starts) <= 1:
            return chat_body, await self.starter.chat_prompt(chat_body, tenant, param="input")
        low, high = 1, len(starts) - 1  # the answer is in [low, high], or high if nothing fits
        best: tuple[ChatCompletionBody, list[int]] | None = None
        while low <= high:
            count = (low + high) // 2
            shorter = without_oldest_turns(chat_body, starts, count)
            prompt = await self.starter.chat_prompt(shorter, tenant, param="input")
            if self._is_too_long(shorter, prompt):
                low = count + 1
            else:
                best, high = (shorter, prompt), count - 1
        if best is None:
            shortest = without_oldest_turns(chat_body, starts, len(starts) - 1)
            return shortest, await self.starter.chat_prompt(shortest, tenant, param="input")
        return best

    def _is_too_long(self, chat_body: ChatCompletionBody, prompt: list[int]) -> bool:
        return len(prompt) + (chat_body.requested_max_tokens or 1) > self.context.geometry.max_model_len

    # ---- finishing ----------------------------------------------------------------------------

    async def result(self, run: ResponseRun) -> dict[str, Any]:
        """Wait for the whole output: the finished response object. Raises GenerationFailed."""
        result: TextPiece = (await run.started.choices.collect_all())[0]
        return finished(run.head, output_items(run.chat_body, result), run.started.choices.usage(),
                        result.finish_reason)

    async def whole(self, run: ResponseRun) -> dict[str, Any]:
        """The finished response object, stored when asked. Raises GenerationFailed."""
        response = await self.result(run)
        if run.head.body.is_stored:
            with storage_errors("the response"):
                await self.store.add(run.tenant.tenant_id, response, run.items, self.quota_of(run.tenant))
        return response

    async def events(self, run: ResponseRun) -> AsyncGenerator[bytes, None]:
        """The response's stream events; the response is stored once it has ended."""
        events = ResponseEvents(run.head)
        for frame in events.opening():
            yield frame
        try:
            async with aclosing(self.event_batches(run, events)) as batches:
                async for batch in batches:
                    for frame in batch:
                        yield frame
        except GenerationFailed as exc:
            for frame in events.fail(self.failure(exc).message, "server_error"):
                yield frame
        if events.response is not None and run.head.body.is_stored:
            await self._store_quietly(run, events.response)

    async def event_batches(self, run: ResponseRun, events: ResponseEvents) -> AsyncGenerator[list[bytes], None]:
        """The events of each piece the generation makes, `response.in_progress` first unless it was
        sent; the last batch ends the response (`events.response` is set). Raises GenerationFailed."""
        async with aclosing(run.started.choices.interleaved()) as pieces:
            async for _, piece in pieces:
                yield events.in_progress() + self._piece_events(events, run, piece)

    def _piece_events(self, events: ResponseEvents, run: ResponseRun, piece: TextPiece) -> list[bytes]:
        tools = run.tool_stream
        if tools is None:
            frames = events.text(piece.text)
        else:
            content, deltas = tools.take(piece.text, is_last=piece.finish_reason is not None)
            frames = events.text(content) + events.call_deltas(deltas)
        if piece.finish_reason is not None:
            frames += events.finish(piece.finish_reason, run.started.choices.usage())
        return frames

    async def _store_quietly(self, run: ResponseRun, response: dict[str, Any]) -> None:
        """After the last event nobody is left to tell that storing failed: the log is told."""
        try:
            await self.store.add(run.tenant.tenant_id, response, run.items, self.quota_of(run.tenant))
        except Exception:
            logger.exception("response %s could not be stored", run.head.id)

    def failure(self, exc: GenerationFailed) -> APIError:
        """A generation the engine ended with an error, answered as chat completions answer it."""
        return self.starter.failure(exc)

    def quota_of(self, tenant: Tenant) -> ResponseQuota:
        """What the tenant may keep stored: its own limits from the tenants file, else the server's."""
        settings, limits = self.context.settings, tenant.limits
        return ResponseQuota(limits.max_stored_responses or settings.tenant_max_stored_responses,
                             limits.max_stored_response_bytes or settings.tenant_max_stored_response_bytes,
                             limits.max_background_responses or settings.tenant_max_background_responses)


def _translated(body: ResponsesBody, items: list[dict[str, Any]]) -> ChatCompletionBody:
    """The chat body generating the response to these conversation items (canonical)."""
    return chat_body_of(body, parsed_items(items))


def _param_in_responses_terms(exc: APIError, body: ResponsesBody, chat_body: ChatCompletionBody) -> str | None:
    """The field a refusal of the chat machinery names, as the client sent it: the batch class a
    tenant may not use was asked by `background` unless the service tier asked it too."""
    if exc.code == "class_not_allowed" and body.is_background and not chat_body.is_batch_class:
        return "background"
    return RESPONSES_PARAM.get(exc.param or "", exc.param)
