"""Tool calling: tools and earlier calls rendered into the prompt, the model's calls parsed back, and
forced calls (`tool_choice` "required" or a named function) made valid by the grammar.

Rendering. A chat template that knows tools (its source mentions `tools`) gets them, the assistant
`tool_calls` and the tool messages as they are. Otherwise the documented fallback, the Hermes format
that Qwen2.5 and many open models are trained on: the tools' JSON signatures go into the system
message inside `<tools></tools>`, an earlier call becomes `<tool_call>{"name", "arguments"}</tool_call>`
in the assistant's text, and a tool's answer a user turn wrapped in `<tool_response></tool_response>`.

Parsing. With `tool_choice` "auto" the model decides: every `<tool_call>...</tool_call>` block of its
output that holds JSON with a `name` of one of the tools becomes a call, the text around them is the
content. With "required" or a named function the output is constrained, as vLLM does, to a JSON
array of `{"name", "parameters"}` objects (one of the tools each) or to the named function's
arguments object, so the arguments always validate against the tool's schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from app.serving.schemas import ChatCompletionBody, ChatMessage, NamedToolChoice, Tool
from contract.plan import StructuredOutput

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FALLBACK_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(slots=True, frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, "call_" + uuid.uuid4().hex[:24])


def uses_tools(body: ChatCompletionBody) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


# ---- rendering -------------------------------------------------------------------------------


def template_messages(body: ChatCompletionBody, template_knows_tools: bool) -> list[dict[str, Any]]:
    """The messages as the chat template gets them (tools passed apart when it knows them)."""
    if template_knows_tools:
        return [_native_message(message) for message in body.messages]
    messages = [_fallback_message(message) for message in body.messages]
    if body.tools and body.tool_choice != "none":
        return _with_tools_in_system(messages, body.tools)
    return messages


def template_tools(body: ChatCompletionBody) -> list[dict[str, Any]] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    return [tool.model_dump(exclude_none=True, by_alias=True) for tool in body.tools]


def _native_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _parsed_or_text(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _fallback_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text}\n</tool_response>"}
    calls = [f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": call.function.name,
                                                "arguments": _parsed_or_text(call.function.arguments)},
                                               ensure_ascii=False) + f"\n{TOOL_CALL_CLOSE}"
             for call in message.tool_calls or []]
    return {"role": message.role, "content": "\n".join(part for part in [message.text, *calls] if part)}


def _with_tools_in_system(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    signatures = "\n".join(json.dumps(tool.model_dump(exclude_none=True, by_alias=True), ensure_ascii=False)
                           for tool in tools)
    prompt = FALLBACK_SYSTEM_PROMPT.format(tools=signatures)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _parsed_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- forcing ---------------------------------------------------------------------------------


def forced_structure(body: ChatCompletionBody) -> StructuredOutput | None:
    """The grammar that makes a required or named call valid; None when the model may answer freely."""
    if not body.tools or body.tool_choice in (None, "none", "auto"):
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        tool = named_tool(body)
        return StructuredOutput("json_schema", json.dumps(tool.function.parameters or ANY_OBJECT))
    choices = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                 "parameters": tool.function.parameters or ANY_OBJECT},
                "required": ["name", "parameters"], "additionalProperties": False} for tool in body.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutput("json_schema", json.dumps(schema))


def named_tool(body: ChatCompletionBody) -> Tool:
    assert isinstance(body.tool_choice, NamedToolChoice)
    for tool in body.tools or []:
        if tool.function.name == body.tool_choice.function.name:
            return tool
    raise LookupError(body.tool_choice.function.name)


# ---- parsing ---------------------------------------------------------------------------------


def parse_output(body: ChatCompletionBody, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output when tools are in use."""
    if isinstance(body.tool_choice, NamedToolChoice):
        return None, [new_call(body.tool_choice.function.name, text)]
    if body.tool_choice == "required":
        return None, _forced_calls(text)
    return _auto_calls(text, {tool.function.name for tool in body.tools or []})


def _forced_calls(text: str) -> list[ToolCall]:
    try:
        items = json.loads(text)
    except ValueError:
        return []  # cut short by max_tokens: no complete call to return
    return [new_call(item["name"], item["parameters"]) for item in items]


def _auto_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    content: list[str] = []
    rest = text
    while (start := rest.find(TOOL_CALL_OPEN)) >= 0:
        end = rest.find(TOOL_CALL_CLOSE, start)
        block = rest[start + len(TOOL_CALL_OPEN):end if end >= 0 else len(rest)]
        call = _call_in(block, names)
        if call is None:  # not a call after all: keep it as text
            content.append(rest[:end + len(TOOL_CALL_CLOSE)] if end >= 0 else rest)
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(TOOL_CALL_CLOSE):] if end >= 0 else ""
    content.append(rest)
    joined = "".join(content).strip() if calls else "".join(content)
    return (joined or None) if calls else joined, calls


def _call_in(block: str, names: set[str]) -> ToolCall | None:
    try:
        parsed = json.loads(block)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("name") not in names:
        return None
    return new_call(parsed["name"], parsed.get("arguments", parsed.get("parameters", {})))


def tool_finish_reason(finish_reason: str, has_calls: bool) -> str:
    """OpenAI's "tool_calls" when the output ended on its own with calls in it."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


class ToolStream:
    """One streamed choice's output while tools are in use: the content to send now and the tool-call
    deltas. Named calls stream their arguments as they come; with "auto", content streams until the
    start of a `<tool_call>` block is seen, and the calls are sent when the output ends; with
    "required", the calls are sent when the output (a JSON array) ends."""

    def __init__(self, body: ChatCompletionBody) -> None:
        self._body = body
        self._named = new_call(body.tool_choice.function.name, "") \
            if isinstance(body.tool_choice, NamedToolChoice) else None
        self._buffer = ""  # the output held back since a call may have started
        self._is_buffering = body.tool_choice == "required"
        self._num_calls = 0

    @property
    def has_calls(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._named is not None:
            return "", self._named_delta(text)
        if self._is_buffering:
            self._buffer += text
            return "", []
        buffer = self._buffer + text
        start = buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            self._is_buffering, self._buffer = True, buffer[start:]
            return buffer[:start], []
        held = _partial_marker_length(buffer)
        self._buffer = buffer[len(buffer) - held:]
        return buffer[:len(buffer) - held], []

    def take(self, text: str, is_last: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content to send now and the tool-call deltas for one piece of output; the last piece
        also releases what was held back."""
        content, deltas = self.feed(text)
        if is_last:
            tail, more = self.finish()
            content, deltas = content + tail, deltas + more
        return content, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._named is not None:
            return "", []
        content, calls = parse_output(self._body, self._buffer)
        self._num_calls = len(calls)
        return content or "", [call.as_dict(index) for index, call in enumerate(calls)]

    def _named_delta(self, text: str) -> list[dict[str, Any]]:
        assert self._named is not None
        if self._num_calls == 0:
            self._num_calls = 1
            return [{**self._named.as_dict(0), "function": {"name": self._named.name, "arguments": text}}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []


def _partial_marker_length(text: str) -> int:
    """How many trailing characters could be the start of `<tool_call>`."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0
