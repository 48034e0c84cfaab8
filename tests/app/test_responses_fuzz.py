"""Whatever JSON a client sends to /v1/responses, the answer is never a 5xx and never a hang: bad input
is the client's 4xx, in OpenAI's error shape."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.app.conftest import INSTANT, ServerThread
from tests.app.test_fuzz import assert_not_a_server_error, json_values, schema, small_ints, strings, unit_floats

text_part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"])
                                   | json_values, "text": strings | json_values})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | json_values,
     "content": strings | st.lists(text_part, max_size=3) | json_values},
    optional={"type": st.just("message") | json_values, "id": strings, "status": strings})
function_call = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": strings | json_values,
                                       "name": strings | json_values, "arguments": strings | json_values})
function_output = st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": strings | json_values,
                                         "output": strings | st.lists(text_part, max_size=2) | json_values})
items = st.lists(message | function_call | function_output | json_values, max_size=4)
function_tool = st.fixed_dictionaries({"type": st.just("function"), "name": strings | json_values},
                                      optional={"parameters": schema | json_values, "strict": st.booleans()})
hosted_tool = st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "code_interpreter"])})
text_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"]) | json_values},
    optional={"name": strings, "schema": schema | json_values, "strict": st.booleans()})

OPTIONAL_FIELDS = {
    "instructions": strings | json_values,
    "max_output_tokens": small_ints | json_values,
    "temperature": unit_floats | json_values,
    "top_p": unit_floats | json_values,
    "text": st.fixed_dictionaries({}, optional={"format": text_format | json_values,
                                                "verbosity": st.sampled_from(["low", "medium"])}) | json_values,
    "tools": st.lists(function_tool | hosted_tool, max_size=2) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "name": strings}) | json_values,
    "parallel_tool_calls": st.booleans() | json_values,
    "metadata": st.dictionaries(strings, strings, max_size=3) | json_values,
    "user": strings | json_values,
    "service_tier": st.sampled_from(["auto", "default", "flex", "priority", "gold"]) | json_values,
    "store": st.booleans() | json_values,
    "background": st.booleans() | json_values,
    "previous_response_id": st.just("resp_nope") | strings | json_values,
    "truncation": st.sampled_from(["auto", "disabled"]) | json_values,
    "stream": st.booleans() | json_values,
    "include": st.lists(strings, max_size=2) | json_values,
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low"])}) | json_values,
    "ignore_eos": st.booleans(),
}
bodies = st.fixed_dictionaries({"model": st.just(INSTANT), "input": strings | items}, optional=OPTIONAL_FIELDS) \
    | st.fixed_dictionaries({}, optional={"model": st.just(INSTANT) | json_values, "input": items | json_values,
                                          **OPTIONAL_FIELDS}) | json_values


ids = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=24)


@pytest.fixture(scope="module")
def http(instant_server: ServerThread) -> Iterator[httpx.Client]:
    with instant_server.in_process_client(timeout=30) as client:
        yield client


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_random_response_bodies_never_get_a_5xx(http: httpx.Client, body: Any) -> None:
    assert_not_a_server_error(http.post("/v1/responses", content=json.dumps(body)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(response_id=ids, path=st.sampled_from(["", "/input_items", "/cancel"]),
       query=st.sampled_from(["", "?limit=0", "?limit=abc", "?order=up", "?after=x", "?stream=true"]))
def test_random_ids_and_queries_are_404_or_400(http: httpx.Client, response_id: str, path: str, query: str) -> None:
    method = "POST" if path == "/cancel" else "GET"
    response = http.request(method, f"/v1/responses/{response_id}{path}{query}")
    assert_not_a_server_error(response)
