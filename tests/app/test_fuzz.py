"""Whatever JSON a client sends, the answer is never a 5xx: bad input is the client's 4xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.app.conftest import INSTANT, ServerThread

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
small_ints = st.integers(min_value=-3, max_value=40)
unit_floats = st.floats(min_value=-0.5, max_value=2.5, allow_nan=False)
strings = st.text(max_size=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]) | json_values,
     "content": strings | st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values,
                                                          "text": strings | json_values}), max_size=3)
                | json_values},
    optional={"name": strings | json_values, "tool_calls": json_values})

# Plausible values most of the time, so validation gets past the first field and into generation.
MODEL = st.just(INSTANT) | json_values
MESSAGES = st.lists(message, min_size=1, max_size=3) | json_values
token_ids = st.lists(st.integers(min_value=-1, max_value=400), max_size=4)
PROMPT = strings | st.lists(strings, max_size=3) | token_ids | st.lists(token_ids, max_size=3) | json_values
penalties = st.floats(min_value=-2.5, max_value=2.5, allow_nan=False) | json_values
schema = st.fixed_dictionaries({"type": st.just("object") | json_values},
                               optional={"properties": json_values, "required": json_values})
OPTIONAL_FIELDS = {
    "max_tokens": small_ints | json_values,
    "max_completion_tokens": small_ints | json_values,
    "temperature": unit_floats | json_values,
    "top_p": unit_floats | json_values,
    "seed": st.integers() | json_values,
    "stop": strings | st.lists(strings, max_size=6) | json_values,
    "n": small_ints | json_values,
    "stream": st.booleans() | json_values,
    "service_tier": st.sampled_from(["auto", "default", "flex", "batch", "priority", "gold"]) | json_values,
    "user": strings | json_values,
    "ignore_eos": st.booleans() | json_values,
    "logprobs": st.booleans() | small_ints | json_values,
    "top_logprobs": small_ints | json_values,
    "presence_penalty": penalties,
    "frequency_penalty": penalties,
    "repetition_penalty": penalties,
    "logit_bias": st.dictionaries(st.integers(min_value=-1, max_value=400).map(str) | strings,
                                  st.floats(min_value=-120, max_value=120, allow_nan=False) | json_values,
                                  max_size=3) | json_values,
    "top_k": small_ints | json_values,
    "min_p": unit_floats | json_values,
    "min_tokens": small_ints | json_values,
    "stop_token_ids": token_ids | json_values,
    "best_of": small_ints | json_values,
    "echo": st.booleans() | json_values,
    "suffix": strings | json_values,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"]) | json_values},
        optional={"json_schema": st.fixed_dictionaries({"name": strings}, optional={"schema": schema,
                                                                                     "strict": st.booleans()})
                  | json_values}) | json_values,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": strings}, optional={"parameters": schema | json_values})}), max_size=2) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values,
                                                          "continuous_usage_stats": st.booleans()}) | json_values,
}
chat_bodies = st.fixed_dictionaries({"model": st.just(INSTANT), "messages": MESSAGES}, optional=OPTIONAL_FIELDS)
completion_bodies = st.fixed_dictionaries({"model": st.just(INSTANT), "prompt": PROMPT}, optional=OPTIONAL_FIELDS)
shapeless_bodies = st.fixed_dictionaries(
    {}, optional={"model": MODEL, "messages": MESSAGES, "prompt": PROMPT, **OPTIONAL_FIELDS}) | json_values
requests = st.tuples(st.just("/v1/chat/completions"), chat_bodies | shapeless_bodies) \
    | st.tuples(st.just("/v1/completions"), completion_bodies | shapeless_bodies) \
    | st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
                st.fixed_dictionaries({}, optional={"prompt": PROMPT, "messages": MESSAGES, "tokens": PROMPT,
                                                    "model": MODEL}))


@pytest.fixture(scope="module")
def http(instant_server: ServerThread) -> Iterator[httpx.Client]:
    with instant_server.in_process_client(timeout=30) as client:
        yield client


def assert_not_a_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_random_json_bodies_never_get_a_5xx(http: httpx.Client, request: tuple[str, Any]) -> None:
    path, body = request
    assert_not_a_server_error(http.post(path, content=json.dumps(body)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_bytes_never_get_a_5xx(http: httpx.Client, raw: bytes, path: str) -> None:
    assert_not_a_server_error(http.post(path, content=raw))
