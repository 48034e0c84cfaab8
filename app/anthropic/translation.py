"""From a Messages request to the chat completions body the chat machinery runs, and from the chat
machinery's output back to Anthropic's content blocks and stop reasons.

The mapping, field by field:
- `system` becomes the first, system message (a system message among the others stays in its
  place); a user message's `tool_result` blocks become tool
  messages (in their order, around the text), an assistant's `tool_use` blocks its `tool_calls`.
- `tools[].input_schema` is a function's `parameters`; `tool_choice` auto / any / tool / none is
  "auto" / "required" / the named function / "none", and `disable_parallel_tool_use` is
  `parallel_tool_calls: false`. Forced calls are shaped by the grammar engine as in chat.
- `stop_sequences` are stop strings; `max_tokens`, `temperature`, `top_p` and `top_k` keep their names.
- `cache_control` marks go with what they mark, so the chat machinery finds the breakpoint there
  (`ChatCompletionBody.cache_breakpoint`): a text block's on its text part, a tool_use's on its
  assistant message, a tool_result's (or one of its text blocks') on its tool message. Tools are
  rendered by chat templates in the system area, ahead of every message: a tool definition's mark goes
  on the first chat message (the system message when there is one). The top-level mark (automatic
  caching) goes on the last message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from app.anthropic.schemas import (
    Message,
    MessagesBody,
    MessagesInput,
    NamedToolChoice,
    NoToolChoice,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from app.serving.schemas import CacheControl, ChatCompletionBody
from app.serving.tools import ToolCall

OPENAI_CALL_PREFIX = "call_"
TOOL_USE_PREFIX = "toolu_"


def chat_body(body: MessagesInput) -> ChatCompletionBody:
    """The chat completions body that asks the chat machinery for this request's answer."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), **_tool_fields(body)}
    if isinstance(body, MessagesBody):
        fields.update(_sampling_fields(body))
    return ChatCompletionBody.model_validate(fields)


def chat_messages(body: MessagesInput) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _text_parts(body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages.extend(_TURNS[message.role](message))
    for tool in body.tools or []:
        _mark(messages[0], tool.cache_control)
    _mark(messages[-1], body.cache_control)
    return messages


def _mark(message: dict[str, Any], control: CacheControl | None) -> None:
    """Put a cache_control on a chat message; of two on one message, the longer TTL is kept."""
    if control is None:
        return
    held = message.get("cache_control")
    if held is None or CacheControl.model_validate(held).ttl_s < control.ttl_s:
        message["cache_control"] = _cache_control(control)


def _cache_control(control: CacheControl) -> dict[str, Any]:
    return control.model_dump(exclude_none=True)


def _user_turn(message: Message) -> list[dict[str, Any]]:
    """A user message as chat messages: each tool result its own tool message, each run of text one
    user message, in the order they come."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    turn: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block)
            continue
        if texts:
            turn.append({"role": "user", "content": _text_parts(texts)})
            texts = []
        if isinstance(block, ToolResultBlock):
            turn.append(_tool_message(block))
    if texts or not turn:
        turn.append({"role": "user", "content": _text_parts(texts)})
    return turn


def _tool_message(block: ToolResultBlock) -> dict[str, Any]:
    """A tool's answer as a tool message, carrying its own mark or one of its text blocks'."""
    tool_message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text}
    _mark(tool_message, block.cache_control)
    for part in block.content if isinstance(block.content, list) else []:
        if isinstance(part, TextBlock):
            _mark(tool_message, part.cache_control)
    return tool_message


def _system_turn(message: Message) -> list[dict[str, Any]]:
    content = message.content
    return [{"role": "system", "content": content if isinstance(content, str) else
             _text_parts([block for block in content if isinstance(block, TextBlock)])}]


def _assistant_turn(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "assistant", "content": message.content}]
    texts = [block for block in message.content if isinstance(block, TextBlock)]
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    if not calls:
        return [{"role": "assistant", "content": _text_parts(texts)}]
    turn: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else None, "tool_calls": calls}
    for block in message.content:
        if isinstance(block, ToolUseBlock):
            _mark(turn, block.cache_control)
    return [turn]


def _text_parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": block.text,
             **({} if block.cache_control is None else {"cache_control": _cache_control(block.cache_control)})}
            for block in blocks]


_TURNS: dict[str, Callable[[Message], list[dict[str, Any]]]] = {
    "user": _user_turn, "assistant": _assistant_turn, "system": _system_turn}


def _tool_fields(body: MessagesInput) -> dict[str, Any]:
    if not body.tools:
        return {}
    fields: dict[str, Any] = {"tools": [
        {"type": "function", "function": {"name": tool.name, "parameters": tool.input_schema,
                                          **({"description": tool.description} if tool.description else {})}}
        for tool in body.tools]}
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice is not None and not isinstance(choice, NoToolChoice) and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _sampling_fields(body: MessagesBody) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": bool(body.stream)}
    optional = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                "stop": body.stop_sequences}
    fields.update({name: value for name, value in optional.items() if value is not None})
    return fields


# ---- output ------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call the chat machinery named in OpenAI's style."""
    return TOOL_USE_PREFIX + call_id.removeprefix(OPENAI_CALL_PREFIX)


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's input object; None when the output holds no complete object (cut by max_tokens)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def tool_use_blocks(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The calls whose input is a complete object, as tool_use blocks."""
    blocks = []
    for call in calls:
        arguments = tool_input(call.arguments)
        if arguments is not None:
            blocks.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments})
    return blocks


def stop_reason(finish_reason: str | None, stop_string: str | None, has_tool_use: bool) -> str:
    """Anthropic's stop_reason of an output that ended with the chat machinery's finish_reason."""
    if finish_reason == "length":
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "tool_use" if has_tool_use else "end_turn"
