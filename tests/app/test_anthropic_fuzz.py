"""Whatever JSON a client sends to the Messages API, the answer is never a 5xx nor a hang, and every
error is in Anthropic's shape: bad input is the client's 4xx."""

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
strings = st.text(max_size=12)


def mostly(valid: st.SearchStrategy[Any], otherwise: st.SearchStrategy[Any] = json_values) -> st.SearchStrategy[Any]:
    """A valid value seven times in eight, else any JSON: with several fields in a body, enough bodies
    get past validation to be generated, streamed and not."""
    return st.integers(min_value=0, max_value=7).flatmap(lambda roll: valid if roll else otherwise)


small_ints = st.integers(min_value=-3, max_value=40)
unit_floats = st.floats(min_value=-0.5, max_value=1.5, allow_nan=False)
schema = st.fixed_dictionaries({"type": mostly(st.just("object"))},
                               optional={"properties": json_values, "required": json_values})
tool_names = st.sampled_from(["weather", "time"]) | strings
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": mostly(strings)},
                                   optional={"cache_control": mostly(st.just({"type": "ephemeral"}))})
tool_use_block = st.fixed_dictionaries({"type": st.just("tool_use"), "id": strings, "name": tool_names,
                                        "input": mostly(st.dictionaries(st.text(max_size=6), json_values,
                                                                        max_size=3))})
tool_result_block = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": strings},
    optional={"content": mostly(strings | st.lists(text_block, max_size=2)), "is_error": st.booleans()})
other_block = st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking", "hologram"])},
                                    optional={"source": json_values, "thinking": strings})
block = mostly(text_block | tool_use_block | tool_result_block | other_block)
message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "system"])),
                                 "content": mostly(strings | st.lists(block, max_size=3))})
question = st.fixed_dictionaries({"role": st.just("user"), "content": mostly(strings | st.lists(block, max_size=2))})
MESSAGES = mostly(st.tuples(st.lists(message, max_size=2), question).map(lambda turns: [*turns[0], turns[1]]))
tool = st.fixed_dictionaries({"name": tool_names, "input_schema": mostly(schema)},
                             optional={"description": strings, "type": mostly(st.just("custom"))})
tool_choice = st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "some"])},
                                    optional={"name": tool_names, "disable_parallel_tool_use": st.booleans()})
PROMPT_FIELDS = {
    "system": mostly(strings | st.lists(text_block, max_size=2)),
    "tools": mostly(st.lists(tool, max_size=2)),
    "tool_choice": mostly(tool_choice),
    "thinking": mostly(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])},
                                             optional={"budget_tokens": small_ints})),
}
GENERATION_FIELDS = {
    "stop_sequences": mostly(st.lists(strings, max_size=5)),
    "stream": mostly(st.booleans()),
    "temperature": mostly(unit_floats),
    "top_p": mostly(unit_floats),
    "top_k": mostly(small_ints),
    "metadata": mostly(st.fixed_dictionaries({}, optional={"user_id": mostly(strings)})),
    "service_tier": mostly(st.sampled_from(["auto", "standard_only", "priority"])),
}
messages_bodies = st.fixed_dictionaries({"model": st.just(INSTANT), "max_tokens": mostly(small_ints),
                                         "messages": MESSAGES}, optional={**PROMPT_FIELDS, **GENERATION_FIELDS})
count_bodies = st.fixed_dictionaries({"model": st.just(INSTANT), "messages": MESSAGES}, optional=PROMPT_FIELDS)
shapeless_bodies = st.fixed_dictionaries(
    {}, optional={"model": mostly(st.just(INSTANT)), "max_tokens": small_ints, "messages": MESSAGES,
                  **PROMPT_FIELDS, **GENERATION_FIELDS}) | json_values
requests = st.tuples(st.just("/v1/messages"), mostly(messages_bodies, shapeless_bodies)) \
    | st.tuples(st.just("/v1/messages/count_tokens"), mostly(count_bodies, shapeless_bodies))


@pytest.fixture(scope="module")
def http(instant_server: ServerThread) -> Iterator[httpx.Client]:
    # The timeout is the "no hang" check: the instant model answers any of these at once.
    with instant_server.in_process_client(timeout=30) as client:
        yield client


def assert_a_client_error_at_most(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert body.keys() == {"type", "error"} and body["type"] == "error"
        assert body["error"].keys() == {"type", "message"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.content.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_random_json_bodies_never_get_a_5xx(http: httpx.Client, request: tuple[str, Any]) -> None:
    path, body = request
    assert_a_client_error_at_most(http.post(path, content=json.dumps(body)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_random_bytes_never_get_a_5xx(http: httpx.Client, raw: bytes, path: str) -> None:
    assert_a_client_error_at_most(http.post(path, content=raw))
