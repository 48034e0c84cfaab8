"""From a Responses request to the chat machinery and back.

Conversation items are kept in one canonical shape (OpenAI's input item objects, each with an id),
which is what `input_items` lists and what a continuation reads back. The chat body built from them
is validated as any chat completions body is, so tools, formats and sampling follow the same rules;
its refusals are renamed into the Responses fields they came from.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from app.plumbing.errors import APIError
from app.responses.schemas import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesBody,
)
from app.serving.generation import TextPiece
from app.serving.schemas import ChatCompletionBody, FieldRefused
from app.serving.tools import parse_output, uses_tools

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
# A chat body's field -> the Responses field a client sent it as.
RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ---- canonical items --------------------------------------------------------------------------


def canonical_items(items: list[Item]) -> list[dict[str, Any]]:
    """The items as stored and listed: every one with an id and a status, message content as parts."""
    return [_canonical(item) for item in items]


def _canonical(item: Item) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        part_type = "output_text" if item.role == "assistant" else "input_text"
        content = [{"type": part_type, "text": item.content}] if isinstance(item.content, str) \
            else [part.model_dump(exclude_none=True) for part in item.content]
        if item.role == "assistant":
            content = [{**part, "annotations": part.get("annotations", [])} if part["type"] == "output_text"
                       else part for part in content]
        return {"id": item.id or new_id("msg_"), "type": "message", "role": item.role, "content": content,
                "status": item.status or "completed"}
    prefix = "fc_" if isinstance(item, FunctionCallItem) else "fco_"
    fields = item.model_dump(exclude_none=True)
    return {**fields, "id": item.id or new_id(prefix), "status": item.status or "completed"}


def parsed_items(stored: list[dict[str, Any]]) -> list[Item]:
    """Canonical items (stored, or a response's output) as input items again."""
    return list(INPUT_ITEMS.validate_python(stored))


# ---- to a chat completion ---------------------------------------------------------------------


def chat_body_of(body: ResponsesBody, items: list[Item]) -> ChatCompletionBody:
    """The chat completions body that generates this response; a 400 in Responses' terms if the
    conversation or the tools do not make a valid one."""
    fields: dict[str, Any] = {
        "model": body.model, "messages": chat_messages(body.instructions, items),
        "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "service_tier": body.service_tier, "metadata": body.metadata,
        # A forced call makes this turn's output a call, never text: text.format shapes the turns after it.
        "response_format": None if _forces_a_call(body) else _response_format(body),
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                  for tool in body.function_tools] or None,
        "tool_choice": _tool_choice(body), "parallel_tool_calls": body.parallel_tool_calls, "seed": body.seed,
        "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "ignore_eos": body.ignore_eos, "cache_salt": body.cache_salt,
    }
    try:
        chat_body = ChatCompletionBody.model_validate({name: value for name, value in fields.items()
                                                       if value is not None})
        chat_body.check_fields()
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise APIError(400, f"The conversation cannot be rendered: {first['msg']}", param="input",
                       code="invalid_value") from None
    except FieldRefused as exc:
        raise APIError(400, str(exc), param=RESPONSES_PARAM.get(exc.param, exc.param), code=exc.code) from None
    return chat_body


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """The chat messages of a conversation: instructions as the system message, a function call as
    a tool call of the assistant turn it belongs to, a call's output as a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    if not messages:
        raise APIError(400, "The conversation is empty: give 'input' or 'instructions'.", param="input")
    return messages


def turn_starts(chat_body: ChatCompletionBody) -> list[int]:
    """`truncation: auto` drops whole turns, oldest first: the index of each message that starts one
    (every message after the system ones but the tool answers, which belong to the turn before)."""
    messages = chat_body.messages
    first = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    return [i for i in range(first, len(messages)) if messages[i].role != "tool"]


def without_oldest_turns(chat_body: ChatCompletionBody, starts: list[int], count: int) -> ChatCompletionBody:
    """The conversation less its `count` oldest turns (`starts` from `turn_starts`); the system
    messages stay, and at least the last turn."""
    assert 0 < count < len(starts)
    messages = list(chat_body.messages)
    return chat_body.model_copy(update={"messages": messages[:starts[0]] + messages[starts[count]:]})


def _response_format(body: ResponsesBody) -> dict[str, Any] | None:
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name, "schema": text_format.schema_, "description": text_format.description,
              "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


def _forces_a_call(body: ResponsesBody) -> bool:
    return bool(body.function_tools) and (body.tool_choice == "required" or isinstance(body.tool_choice,
                                                                                       FunctionChoice))


def _tool_choice(body: ResponsesBody) -> str | dict[str, Any] | None:
    if isinstance(body.tool_choice, FunctionChoice):
        return {"type": "function", "function": {"name": body.tool_choice.name}}
    return body.tool_choice if isinstance(body.tool_choice, str) else None


# ---- back to output items ---------------------------------------------------------------------


def output_items(chat_body: ChatCompletionBody, result: TextPiece) -> list[dict[str, Any]]:
    """A finished generation as output items: its text as a message (unless it is only calls), then
    each function call the model made."""
    content, calls = parse_output(chat_body, result.text) if uses_tools(chat_body) else (result.text, [])
    if not calls:
        content = result.text  # e.g. a forced call cut short: its raw text is all there is
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items = [message_item(new_id("msg_"), content or "", status)] if content or not calls else []
    items += [function_call_item(new_id("fc_"), call.id, call.name, call.arguments) for call in calls]
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
                       ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
