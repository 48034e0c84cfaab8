"""The OpenAI request bodies this server accepts, validated by pydantic.

Strict on purpose: a string where a number belongs, a float where an integer belongs, or a field
this server does not know is a 400 that names the field, never a silent guess. Responses are not
modelled here: they are built as plain dicts (see `app/responses.py`) because the token stream is
the hot path.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# 'flex' and 'batch' ask for the batch class; every other tier is served as interactive.
ServiceTier = Literal["auto", "default", "flex", "batch", "priority", "scale"]
BATCH_TIERS = frozenset({"flex", "batch"})
MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1

StopString = Annotated[str, Field(min_length=1, max_length=1024)]
PromptText = Annotated[str, Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted for compatibility: chunks never carry obfuscation padding


class TextPart(StrictModel):
    """One part of a message's content; only text parts are understood by a text-only model."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted for compatibility; the chat template has no place for it

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class GenerationBody(StrictModel):
    """The fields the chat and completions endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: StopString | list[StopString] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: ServiceTier | None = None
    user: str | None = None  # accepted and ignored: tenants come from API keys, not from this field
    ignore_eos: bool = False  # an extension (vLLM has it too): run to max_tokens, for benchmarks and tests
    # vLLM's field: isolates this request's prefix-cache entries further than its tenant's salt does.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
        return stop

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(f"only n=1 is supported, got n={n}")
        return n

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def is_batch_class(self) -> bool:
        return self.service_tier in BATCH_TIERS

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        # The newer name wins when a client sends both.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionBody(GenerationBody):
    prompt: PromptText | list[PromptText]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError(f"one prompt per request is supported, got a list of {len(prompt)}")
        return prompt

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
