"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat machinery.

A request goes as a chat completion does: authenticate (`x-api-key` or a Bearer token) -> refuse if
draining -> read the body (bounded) -> validate -> check the model -> translate to a chat body ->
template and tokenize -> check a forced call's schema -> start it through the ChoiceStarter (quotas,
class, engine) -> stream Anthropic's events, or wait for the whole message while watching for the
client to leave. Only the wire shapes differ (`app/anthropic/objects.py`, `app/anthropic/errors.py`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.anthropic.errors import (
    AnthropicError,
    anthropic_errors,
    field_refused,
    from_validation_error,
    not_found,
)
from app.anthropic.objects import PING_EVENT, MessageEvents, MessageHead, error_event
from app.anthropic.schemas import MessagesBody, MessagesInput
from app.anthropic.translation import chat_body, stop_reason, tool_input, tool_use_blocks
from app.plumbing.asgi import EventStreamResponse
from app.plumbing.errors import json_response
from app.serving.bodies import BodyErrors, parsed_body
from app.serving.context import ServingContext
from app.serving.generation import GenerationFailed, TextPiece
from app.serving.off_loop import THREAD_ITEMS
from app.serving.schemas import ChatCompletionBody, NamedToolChoice
from app.serving.submission import ChoiceStarter, Generations, shutting_down
from app.serving.tools import ToolCall, ToolStream, parse_output, uses_tools
from scheduling.request import PriorityClass
from tenancy.tenants import Tenant

InputT = TypeVar("InputT", bound=MessagesInput)
ANTHROPIC_BODY_ERRORS = BodyErrors(from_validation_error, field_refused)
T = TypeVar("T")
MESSAGES_PATH = "/v1/messages"
# While a streamed request waits for its first token (queued behind others, or prefilling a long
# prompt), a ping this often keeps proxies from closing a connection that looks idle.
PING_INTERVAL_S = 5.0
EVERY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class AnthropicRoutes:
    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.starter = ChoiceStarter(context)

    def routes(self) -> list[Route]:
        """Each route takes every method: a wrong one is refused by `anthropic_errors`, in Anthropic's shape."""
        return [
            Route(MESSAGES_PATH, anthropic_errors(self.messages), methods=EVERY_METHOD),
            Route(f"{MESSAGES_PATH}/count_tokens", anthropic_errors(self.count_tokens), methods=EVERY_METHOD),
            Route(MESSAGES_PATH + "/{rest:path}", anthropic_errors(self.unknown_path, methods=None),
                  methods=EVERY_METHOD),
        ]

    async def unknown_path(self, request: Request) -> Response:
        raise not_found(request)

    async def count_tokens(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await self._parse(request, MessagesInput, tenant)
        chat = await self._chat_body(body, tenant)
        return json_response({"input_tokens": len(await self.starter.chat_prompt(chat, tenant))})

    async def messages(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        if self.context.is_draining:
            raise shutting_down()
        body = await self._parse(request, MessagesBody, tenant)
        chat = await self._chat_body(body, tenant)
        prompt = await self.starter.chat_prompt(chat, tenant)
        await self.starter.check_grammar(chat, tenant)
        message_id = "msg_" + uuid.uuid4().hex
        # Every request of this API is interactive: its service tiers both ask for standard capacity.
        started = self.starter.start(message_id, chat, [prompt], tenant, "messages", PriorityClass.INTERACTIVE,
                                     await self.starter.cache_pin(chat, prompt, tenant))
        head = MessageHead(message_id, body.model, started.num_pinnable_tokens)  # the base model or an adapter
        if body.stream:
            return EventStreamResponse(self._events(started, chat, head), started.headers)
        return await self.starter.whole_answer(request, self._whole(started, chat, head), started.headers)

    # ---- from the body to a started generation -------------------------------------------------

    async def _parse(self, request: Request, body_type: type[InputT], tenant: Tenant) -> InputT:
        return await parsed_body(self.context, request, tenant, body_type, ANTHROPIC_BODY_ERRORS)

    async def _chat_body(self, body: MessagesInput, tenant: Tenant) -> ChatCompletionBody:
        return await self.context.off_loop.run_if(len(body.messages) > THREAD_ITEMS, tenant.tenant_id,
                                                  _translated, body)

    # ---- the answer ------------------------------------------------------------------------------

    async def _whole(self, started: Generations, chat: ChatCompletionBody, head: MessageHead) -> dict[str, Any]:
        [result] = await started.choices.collect_all()
        text: str | None = result.text
        calls: list[ToolCall] = []
        if uses_tools(chat):
            text, calls = parse_output(chat, result.text)
        blocks = tool_use_blocks(calls)
        content: list[dict[str, Any]] = [{"type": "text", "text": text or ""}] if text or not blocks else []
        content += blocks
        reason = stop_reason(result.finish_reason, result.stop_string, any(b["type"] == "tool_use" for b in content))
        return head.message(content, reason, result.stop_string, started.choices.usage())

    async def _events(self, started: Generations, chat: ChatCompletionBody, head: MessageHead
                      ) -> AsyncGenerator[bytes, None]:
        events = MessageEvents(head)
        tools = started.tool_streams[0] if started.tool_streams else None
        yield events.start(started.choices.usage())
        try:
            # Both closed here, whatever ends the stream: closing the pieces aborts an unfinished request.
            async with aclosing(started.choices.interleaved()) as pieces, \
                    aclosing(_pinging(pieces, PING_INTERVAL_S)) as pinged:
                async for item in pinged:
                    if item is None:
                        yield PING_EVENT
                        continue
                    _, piece = item
                    sent = self._piece_events(events, tools, piece, chat, started)
                    if sent:
                        yield sent
        except GenerationFailed as exc:
            yield error_event(AnthropicError.of(self.starter.failure(exc)).body())

    @staticmethod
    def _piece_events(events: MessageEvents, tools: ToolStream | None, piece: TextPiece, chat: ChatCompletionBody,
                      started: Generations) -> bytes:
        if tools is None:
            sent = events.text(piece.text) if piece.text else b""
        else:
            sent = _tool_stream_events(events, tools, piece, is_named=isinstance(chat.tool_choice, NamedToolChoice))
        if piece.finish_reason is not None:
            reason = stop_reason(piece.finish_reason, piece.stop_string, events.has_tool_use)
            sent += events.stop(reason, piece.stop_string, started.choices.usage())
        return sent


def _tool_stream_events(events: MessageEvents, tools: ToolStream, piece: TextPiece, *, is_named: bool) -> bytes:
    """The events of one piece of an output that may hold tool calls. A named call streams its input
    as it comes; the others come whole at the end, and one without a complete input object is left out."""
    content, deltas = tools.take(piece.text, is_last=piece.finish_reason is not None)
    if not is_named:
        deltas = [delta for delta in deltas if tool_input(delta["function"]["arguments"]) is not None]
    sent = events.text(content) if content else b""
    return sent + b"".join(events.tool_call(delta) for delta in deltas)


async def _pinging(items: AsyncIterator[T], interval_s: float) -> AsyncGenerator[T | None, None]:
    """The items, with a None (a ping to send) for every interval_s that passes before the first one.
    After the first, they are passed on as they come: tokens keep the connection busy. The caller
    closes `items`."""
    first = asyncio.ensure_future(anext(items))
    try:
        while not (await asyncio.wait({first}, timeout=interval_s))[0]:
            yield None
    finally:
        if not first.done():  # the reader left while waiting: stop the wait, and with it the generation
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    try:
        first_item = first.result()
    except StopAsyncIteration:
        return
    yield first_item
    async for item in items:
        yield item


def _translated(body: MessagesInput) -> ChatCompletionBody:
    """The translation is valid by construction; if it is not, say so as the client's 400 rather
    than as a server error, since it was made from what the client sent."""
    try:
        return chat_body(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
