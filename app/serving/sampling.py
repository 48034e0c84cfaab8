"""From a request body to the engine's SamplingParams (best_of's pick of its choices is OpenAI's own:
app/openai/answers.py)."""

from __future__ import annotations

import json
from dataclasses import replace

from app.plumbing.errors import APIError
from app.serving.schemas import ChatCompletionBody, CompletionBody, GenerationBody
from app.serving.tools import forced_structure
from contract.plan import SamplingParams, StructuredOutput
from gpu.tokenizer import Tokenizer

# Below this temperature sampling is greedy: logits / temperature would overflow float32 near 0.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_params(body: GenerationBody, tokenizer: Tokenizer, grammar_scope: str = "") -> SamplingParams:
    """The body's sampling fields with OpenAI's defaults (temperature 1, top_p 1). `min_tokens_banned`
    is left for the caller, who knows the request's stop tokens."""
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature < GREEDY_BELOW_TEMPERATURE:
        temperature = 0.0
    logprobs = body.num_logprobs
    if logprobs is None and body.num_generations > body.num_choices:
        logprobs = 0  # best_of ranks its choices by the log probability of their tokens
    return SamplingParams(
        temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k if body.top_k is not None and body.top_k > 0 else 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=logit_bias_of(body, tokenizer.vocab_size),
        min_tokens=min_tokens_of(body),
        logprobs=logprobs,
        prompt_logprobs=body.logprobs if isinstance(body, CompletionBody) and body.echo else None,
        structured=structured_output_of(body, grammar_scope),
    )


def structured_from_response_format(body: GenerationBody) -> bool:
    return isinstance(body, ChatCompletionBody) and body.response_format is not None \
        and body.response_format.type != "text"


def structured_output_of(body: GenerationBody, scope: str = "") -> StructuredOutput | None:
    """The grammar of a forced tool call or of response_format, compiled into `scope`'s grammar
    cache entries; None for free text."""
    if not isinstance(body, ChatCompletionBody):
        return None
    forced = forced_structure(body)
    if forced is not None or body.response_format is None or body.response_format.type == "text":
        return forced if forced is None else replace(forced, scope=scope)
    if body.response_format.type == "json_object":
        return StructuredOutput("json_object", scope=scope)
    assert body.response_format.json_schema is not None
    return StructuredOutput("json_schema", json.dumps(body.response_format.json_schema.schema_ or {}), scope)


def logit_bias_of(body: GenerationBody, vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = tuple(sorted((int(token), value) for token, value in (body.logit_bias or {}).items() if value != 0.0))
    if any(token >= vocab_size for token, _ in bias):
        raise APIError(400, f"logit_bias keys must be token ids below the vocabulary size {vocab_size}.",
                       param="logit_bias", code="invalid_value")
    return bias


def min_tokens_of(body: GenerationBody) -> int:
    min_tokens = body.min_tokens or 0
    max_tokens = body.requested_max_tokens
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).",
                       param="min_tokens", code="invalid_value")
    return min_tokens
