"""The OpenAI request bodies this server accepts, validated by pydantic.

Strict on purpose: a string where a number belongs, a float where an integer belongs, or a field
this server does not know is a 400 that names the field, never a silent guess. Every field of
OpenAI's chat completions and completions references, and vLLM's extra sampling fields, is known:
at its default value it is always accepted; a value that asks for what this server cannot do
(audio, web search, stored completions...) is a 400 that says so (`Unsupported`). Responses are
not modelled here: they are built as plain dicts (see `app/openai/objects.py`) because the token
stream is the hot path.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# 'flex' and 'batch' ask for the batch class; every other tier is served as interactive.
ServiceTier = Literal["auto", "default", "flex", "batch", "priority", "scale", "fast"]
BATCH_TIERS = frozenset({"flex", "batch"})
MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1
MAX_CHOICES = 64  # n (and best_of): each choice holds its own KV blocks while it runs
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 20  # completions' logprobs: OpenAI allows 5, vLLM 20
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CACHE_BREAKPOINTS = 4  # cache_control marks in one request, as Anthropic allows
CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}
DEFAULT_CACHE_TTL = "5m"

StopString = Annotated[str, Field(min_length=1, max_length=1024)]
PromptText = Annotated[str, Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted: chunks never carry obfuscation padding
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk, not only at the end


class CacheControl(StrictModel):
    """An explicit cache breakpoint (Anthropic's `cache_control`): the prompt up to here is kept in the
    prefix cache for the TTL after its last use, within the tenant's pin quota (scheduling/cache_pins.py)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None  # None: 5m

    @property
    def ttl_s(self) -> float:
        return CACHE_TTL_S[self.ttl or DEFAULT_CACHE_TTL]


def cache_control_at(raw: dict[str, Any], param: str) -> CacheControl:
    """A chat message's (or part's) raw cache_control, checked: a FieldRefused naming `param` if it is not
    one. Kept raw in the body so that a bad one inside a part is named plainly, not as a failed union."""
    try:
        return CacheControl.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join([param, *(str(part) for part in first["loc"])])
        if first["type"] == "extra_forbidden":
            raise FieldRefused(f"Unrecognized request argument supplied: {where}", param) from None
        raise FieldRefused(f"Invalid value for '{where}': {first['msg']}", param) from None


class TextPart(StrictModel):
    """One part of a message's content; only text parts are understood by a text-only model."""

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a hint: the prefix cache needs no breakpoints
    cache_control: dict[str, Any] | None = None  # a CacheControl, checked by ChatCompletionBody.check_fields


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant message with tool calls
    name: str | None = None  # accepted for compatibility; the chat template has no place for it
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    refusal: str | None = None  # an assistant's earlier refusal, kept as its text
    audio: dict[str, Any] | None = None  # an earlier audio answer's id: refused (text only)
    function_call: dict[str, Any] | None = None  # the deprecated form of tool_calls: refused
    cache_control: dict[str, Any] | None = None  # a CacheControl, checked by ChatCompletionBody.check_fields

    @model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        if self.audio is not None or self.function_call is not None:
            raise ValueError("audio and function_call are not supported in messages: text and tool_calls only")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def cache_controls(self, where: str) -> list[tuple[str, dict[str, Any]]]:
        """(param, raw cache_control) of the message and of each of its parts that carries one; `where`
        names the message."""
        marked = [] if self.cache_control is None else [(f"{where}.cache_control", self.cache_control)]
        if isinstance(self.content, list):
            marked += [(f"{where}.content.{index}.cache_control", part.cache_control)
                       for index, part in enumerate(self.content) if part.cache_control is not None]
        return marked


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class FieldRefused(ValueError):
    """A field that is well-formed but cannot be honoured: with the other fields it makes no sense
    (code invalid_value), or it asks for something this server cannot do (code unsupported_value)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class Unsupported(FieldRefused):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param, "unsupported_value")


def refuse_unless_default(body: BaseModel, defaults: dict[str, tuple[Any, str]]) -> None:
    """Raise Unsupported for the first field set to a value other than its defaults, with the why."""
    for name, (accepted, why) in defaults.items():
        value = getattr(body, name)
        if value is not None and value not in accepted:
            raise Unsupported(f"'{name}' is not supported by this server: {why}", name)


TTFT_DEADLINE_KEY = "ttft_deadline_ms"
MAX_TTFT_DEADLINE_MS = 3_600_000


class GenerationBody(StrictModel):
    """The fields the chat and completions endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: StopString | list[StopString] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: ServiceTier | None = None
    user: str | None = None  # accepted and ignored: tenants come from API keys, not from this field
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Token id (as a string, as JSON keys are) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: every token
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False  # run to max_tokens, for benchmarks and tests
    # Isolates this request's prefix-cache entries further than its tenant's salt does.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None  # vLLM's priority scheduling; here classes come from service_tier
    # OpenAI fields taken as hints with no effect on the output, or as metadata.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes by itself
    safety_identifier: str | None = None
    store: bool | None = None

    @field_validator("metadata")
    @classmethod
    def _deadline_is_a_duration(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        raw = (metadata or {}).get(TTFT_DEADLINE_KEY)
        if raw is not None:
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not 0 < value <= MAX_TTFT_DEADLINE_MS:
                raise ValueError(f"'{TTFT_DEADLINE_KEY}' must be milliseconds in (0, {MAX_TTFT_DEADLINE_MS}], "
                                 f"got {raw!r}")
        return metadata

    @property
    def ttft_deadline_ms(self) -> float | None:
        """The client's TTFT deadline (metadata `ttft_deadline_ms`): its first token is due this long after
        it arrives, and its tenant's line orders it by slack."""
        raw = (self.metadata or {}).get(TTFT_DEADLINE_KEY)
        return None if raw is None else float(raw)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys are token ids, got {key!r}")
        return bias

    def check_fields(self) -> None:
        """Raise FieldRefused for a field that makes no sense with the others, or Unsupported for one
        set to a value this server cannot honour."""
        if self.stream_options is not None and not self.stream:
            raise FieldRefused("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                               "stream_options")
        refuse_unless_default(self, {
            "store": ((False,), "completions are not stored"),
            "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
            "include_stop_str_in_output": ((False,), "a matched stop string is always left out"),
            "priority": ((0,), "classes come from service_tier ('flex' or 'batch' for the batch class)"),
        })

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_generations(self) -> int:
        """Outputs generated per prompt: n, or best_of when a completions request asks for more."""
        return self.num_choices

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    @property
    def is_batch_class(self) -> bool:
        return self.service_tier in BATCH_TIERS

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """How many top log probabilities each token reports; None when none are asked for."""
        return None


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None
    # Accepted at their defaults; anything else asks for what a text model behind this server cannot do.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None  # a speed hint: the output does not depend on it
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None  # hints: the prefix cache finds shared prefixes itself
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.top_logprobs and not self.logprobs:
            raise FieldRefused("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        refuse_unless_default(self, {
            "modalities": ((["text"],), "the model writes text only"),
            "audio": ((), "the model writes text only"),
            "reasoning_effort": ((), "the model does not reason before it answers"),
            "verbosity": ((), "the model has no verbosity setting"),
            "web_search_options": ((), "it cannot search the web"),
            "moderation": ((), "it has no moderation model"),
            "functions": ((), "use 'tools' instead of the deprecated 'functions'"),
            "function_call": ((), "use 'tool_choice' instead of the deprecated 'function_call'"),
            "add_generation_prompt": ((True,), "the assistant's turn is always opened"),
            "continue_final_message": ((False,), "the assistant's turn is always a new message"),
            "echo": ((False,), "chat completions do not echo the prompt; completions do"),
        })
        self._check_tools()
        self._check_cache_controls()

    def _check_cache_controls(self) -> None:
        marked = [mark for index, message in enumerate(self.messages)
                  for mark in message.cache_controls(f"messages.{index}")]
        for param, raw in marked:
            cache_control_at(raw, param)
        if len(marked) > MAX_CACHE_BREAKPOINTS:
            raise FieldRefused(f"A maximum of {MAX_CACHE_BREAKPOINTS} cache_control breakpoints may be given; "
                               f"found {len(marked)}.", "messages")

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldRefused("Tool names must be unique.", "tools")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise FieldRefused("'tool_choice' asks for a call but no 'tools' are given.", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldRefused(f"tool_choice names '{self.tool_choice.function.name}', which is not one of the "
                               "tools.", "tool_choice")
        forced = self.tool_choice not in (None, "none", "auto") and bool(names)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise FieldRefused("A forced tool call and a response_format cannot both shape the output.",
                               "response_format")

    @property
    def cache_breakpoint(self) -> tuple[int, CacheControl] | None:
        """(index, cache_control) of the last message that carries a cache_control, on itself or on a
        part: the prompt through that message is to be kept. Message granularity: a mark on a part keeps
        its whole message. Of several marks on that message, the longest TTL."""
        for index in reversed(range(len(self.messages))):
            marked = self.messages[index].cache_controls(f"messages.{index}")
            if marked:
                controls = [cache_control_at(raw, param) for param, raw in marked]
                return index, max(controls, key=lambda control: control.ttl_s)
        return None

    @property
    def requested_max_tokens(self) -> int | None:
        # The newer name wins when a client sends both.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionBody(GenerationBody):
    # One prompt or several (one choice each), as text or as token ids.
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.best_of is not None and self.best_of < self.num_choices:
            raise FieldRefused(f"best_of ({self.best_of}) must be at least n ({self.num_choices}).", "best_of")
        refuse_unless_default(self, {"suffix": (("",), "the model cannot fill in the middle")})
        if self.stream and self.num_generations > self.num_choices:
            raise Unsupported("'best_of' greater than 'n' cannot be streamed", "best_of")

    @property
    def num_generations(self) -> int:
        return max(self.best_of or 1, self.num_choices)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, as text or as token ids."""
        prompt: Any = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]
        return list(prompt)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeBody(StrictModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # accepted; the prompt is encoded as the completions endpoint does
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeBody(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
