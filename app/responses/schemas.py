"""The Responses API request body and its input items, validated by pydantic.

Strict as the chat completions bodies are (app/serving/schemas.py): a field of the wrong type, or one
this server does not know, is a 400 naming it. Every field of OpenAI's `POST /v1/responses` is known;
one that asks for what a text model behind this server cannot do (built-in tools, reasoning effort,
`include` items, prompt templates, conversations...) is a 400 that says so (`Unsupported`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from app.serving.schemas import MAX_SEED, FieldRefused, ServiceTier, StrictModel, Unsupported, refuse_unless_default

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
ACCEPTED_REASONING_EFFORTS = (None, "none")  # the model does not reason before it answers


# ---- input items ------------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a hint: the prefix cache needs no breakpoints


class OutputText(StrictModel):
    """An earlier answer's text, as this server (or OpenAI) returned it."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | RefusalPart, Field(discriminator="type")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None  # newer clients tag an assistant message's phase; it does not reach the prompt

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.refusal if isinstance(part, RefusalPart) else part.text for part in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made earlier (this server's `function_call` output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The caller's answer to a function call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_kind(item: Any) -> str | None:
    """An item's type; OpenAI's "easy" messages may leave it out."""
    if isinstance(item, dict):
        kind = item.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


# ---- tools and formats ------------------------------------------------------------------------


class FunctionTool(StrictModel):
    """Responses' flat function tool: the name and schema at the top, not under `function`."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(BaseModel):
    """A built-in tool (web_search, file_search, ...): known, so that it is refused by name."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "hosted"


ToolSpec = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
                     Discriminator(_tool_kind)]


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted: events never carry obfuscation padding


# ---- the body ---------------------------------------------------------------------------------


class ResponsesBody(StrictModel):
    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionChoice | dict[str, Any] | None,
                           Field(union_mode="left_to_right")] = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored: tenants come from API keys, not from this field
    service_tier: ServiceTier | None = None
    store: bool | None = None  # None: stored, as OpenAI does
    background: bool | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    # Known, and refused unless at their defaults (see check_fields).
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[Any] | None = None
    background_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    # Hints with no effect on the output: the prefix cache finds shared prefixes by itself.
    max_tool_calls: int | None = Field(default=None, ge=1)  # bounds built-in tool calls, which never happen here
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # vLLM's extra sampling fields, as on chat completions.
    seed: int | None = Field(default=None, ge=-MAX_SEED - 1, le=MAX_SEED)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    ignore_eos: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("metadata")
    @classmethod
    def _metadata_within_limits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs are allowed, got {len(metadata)}")
        if any(len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE for key, value in metadata.items()):
            raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}")
        return metadata

    def check_fields(self) -> None:
        """Raise FieldRefused for a field that makes no sense with the others, or Unsupported for one
        that asks for what this server cannot do. Tool consistency is checked on the chat body."""
        if self.input is None and self.previous_response_id is None:
            raise FieldRefused("Give 'input', or a 'previous_response_id' to continue from.", "input")
        if self.stream_options is not None and not self.stream:
            raise FieldRefused("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                               "stream_options")
        self._check_background()
        self._check_unsupported()
        self._check_tools()

    def _check_background(self) -> None:
        if not self.background:
            return
        if self.store is False:
            raise FieldRefused("A background response must be stored: it is polled by its id.", "store")

    def _check_unsupported(self) -> None:
        if self.reasoning is not None and (self.reasoning.effort not in ACCEPTED_REASONING_EFFORTS
                                           or self.reasoning.summary or self.reasoning.generate_summary):
            raise Unsupported("'reasoning' is not supported by this server: the model does not reason "
                              "before it answers", "reasoning")
        if self.include:
            raise Unsupported(f"'include' is not supported by this server: it cannot produce "
                              f"{self.include[0]!r}", "include")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise Unsupported("'text.verbosity' is not supported by this server: the model has no verbosity "
                              "setting", "text.verbosity")
        refuse_unless_default(self, {
            "top_logprobs": ((0,), "log probabilities are not reported on responses"),
            "prompt": ((), "there are no stored prompt templates"),
            "conversation": ((), "there is no Conversations API; use 'previous_response_id'"),
            "context_management": (([],), "the context is never compacted"),
            "background_options": (({},), "background responses take no options"),
            "moderation": (({},), "it has no moderation model"),
            "image": (({},), "the model reads and writes text only"),
            "access_programs": (({},), "there are no access programs"),
        })

    def _check_tools(self) -> None:
        for tool in self.tools or []:
            if isinstance(tool, HostedTool):
                raise Unsupported(f"the built-in tool '{tool.type}' is not supported by this server: only "
                                  "function tools are", "tools")
        if isinstance(self.tool_choice, dict):
            raise Unsupported("'tool_choice' is not supported by this server beyond 'none', 'auto', "
                              "'required' or {'type': 'function', 'name': ...}", "tool_choice")

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]

    @property
    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The request's own items; a string input is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def is_stored(self) -> bool:
        return self.store is not False

    @property
    def is_background(self) -> bool:
        return bool(self.background)

    @property
    def is_streamed(self) -> bool:
        return bool(self.stream)
