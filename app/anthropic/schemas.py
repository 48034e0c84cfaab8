"""The Messages API request bodies this server accepts, validated by pydantic.

Strict as the OpenAI bodies are (`app/serving/schemas.py`): a wrong type or a field this server does
not know is a 400 that names the field. Content blocks a text-only model cannot take (images,
documents, thinking...) are known by their type, so that the 400 says which block and why, rather
than that no such block exists. `check_fields` refuses what is well-formed but cannot be honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.serving.schemas import (
    MAX_CACHE_BREAKPOINTS,
    MAX_STOP_STRINGS,
    CacheControl,
    FieldRefused,
    StrictModel,
    Unsupported,
)

ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
StopSequence = Annotated[str, Field(min_length=1, max_length=1024)]

# Block types of Anthropic's API that a text-only model behind this server cannot take, and why.
UNSUPPORTED_BLOCKS = {
    "image": "the model reads text only",
    "document": "the model reads text only",
    "search_result": "the model reads text only",
    "container_upload": "this server runs no code containers",
    "thinking": "the model does not think before it answers",
    "redacted_thinking": "the model does not think before it answers",
    "server_tool_use": "this server runs no server tools",
    "web_search_tool_result": "this server runs no server tools",
    "web_fetch_tool_result": "this server runs no server tools",
    "code_execution_tool_result": "this server runs no server tools",
    "mcp_tool_use": "this server connects to no MCP servers",
    "mcp_tool_result": "this server connects to no MCP servers",
}
UnsupportedType = Literal["image", "document", "search_result", "container_upload", "thinking", "redacted_thinking",
                          "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                          "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result"]


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # an earlier answer's citations: not part of the prompt


class ToolUseBlock(StrictModel):
    """An earlier call of the assistant's, in the history."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # who made the call: the model, here always


class UnsupportedBlock(BaseModel):
    """A block of a known type this server cannot take: whatever its fields, `check_fields` refuses it."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: UnsupportedType


ToolResultContent = Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]


class ToolResultBlock(StrictModel):
    """A tool's answer to an earlier call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None  # accepted; the answer's text is what the model reads
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content if isinstance(block, TextBlock))


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock, Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant", "system"]  # a system message among the others: text only
    content: str | list[ContentBlock]


class ToolDefinition(StrictModel):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON schema of the input object
    type: Literal["custom"] | None = None  # server tools (web search, bash...) have other types: refused
    cache_control: CacheControl | None = None
    strict: bool | None = None  # accepted: a forced call's input always validates (the grammar engine)
    eager_input_streaming: bool | None = None  # accepted: a forced call's input streams as it comes


class AutoToolChoice(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyToolChoice(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class NamedToolChoice(StrictModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class NoToolChoice(StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[AutoToolChoice | AnyToolChoice | NamedToolChoice | NoToolChoice, Field(discriminator="type")]


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=256)  # accepted; tenants come from API keys


class MessagesInput(StrictModel):
    """What makes the prompt: the body of /v1/messages/count_tokens, and the start of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}: the model does not think first
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint after the last message

    def check_fields(self) -> None:
        """Raise FieldRefused for what is well-formed but makes no sense, Unsupported for what this
        server cannot do; the param names the field, down to the content block."""
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise Unsupported("'thinking' is not supported by this server: the model does not think before it "
                              "answers", "thinking")
        for index, message in enumerate(self.messages):
            _check_blocks(message, f"messages.{index}")
        if self.messages[-1].role == "assistant":
            raise Unsupported("A final assistant message (a prefill to continue) is not supported by this server: "
                              "the assistant's turn is always a new message.", f"messages.{len(self.messages) - 1}")
        self._check_tools()
        num_marks = self.num_cache_controls
        if num_marks > MAX_CACHE_BREAKPOINTS:
            raise FieldRefused(f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
                               f"Found {num_marks}.", "cache_control")

    @property
    def num_cache_controls(self) -> int:
        """The breakpoints asked for: blocks (and tools) with a cache_control, and the top-level one."""
        blocks: list[TextBlock | ToolUseBlock | ToolResultBlock | ToolDefinition] = [
            *(self.tools or []), *(self.system if isinstance(self.system, list) else [])]
        for message in self.messages:
            for block in message.content if isinstance(message.content, list) else []:
                if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                    blocks += [part for part in block.content if isinstance(part, TextBlock)]
                if not isinstance(block, UnsupportedBlock):  # refused before this is asked
                    blocks.append(block)
        return sum(block.cache_control is not None for block in blocks) + (self.cache_control is not None)

    def _check_tools(self) -> None:
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldRefused("Tool names must be unique.", "tools")
        choice = self.tool_choice
        if isinstance(choice, AnyToolChoice | NamedToolChoice) and not names:
            raise FieldRefused(f"tool_choice '{choice.type}' asks for a tool call but no 'tools' are given.",
                               "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            raise FieldRefused(f"tool_choice names '{choice.name}', which is not one of the tools.", "tool_choice.name")


def _check_blocks(message: Message, where: str) -> None:
    """Each block in its place: tool calls in the assistant's turns, tool results in the user's."""
    if isinstance(message.content, str):
        return
    for index, block in enumerate(message.content):
        param = f"{where}.content.{index}"
        if isinstance(block, UnsupportedBlock):
            raise Unsupported(f"'{block.type}' content blocks are not supported by this server: "
                              f"{UNSUPPORTED_BLOCKS[block.type]}", param)
        if message.role == "system" and not isinstance(block, TextBlock):
            raise FieldRefused("A system message holds text blocks only.", param)
        if isinstance(block, ToolUseBlock) and message.role != "assistant":
            raise FieldRefused("tool_use blocks belong in assistant messages.", param)
        if isinstance(block, ToolResultBlock) and message.role != "user":
            raise FieldRefused("tool_result blocks belong in user messages.", param)
        if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
            for inner, part in enumerate(block.content):
                if isinstance(part, UnsupportedBlock):
                    raise Unsupported(f"'{part.type}' content blocks are not supported by this server: "
                                      f"{UNSUPPORTED_BLOCKS[part.type]}", f"{param}.content.{inner}")


class MessagesBody(MessagesInput):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopSequence] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # 0: every token
    metadata: Metadata | None = None
    # Both ask for standard capacity; every request of this API is served in the interactive class.
    service_tier: Literal["auto", "standard_only"] | None = None
