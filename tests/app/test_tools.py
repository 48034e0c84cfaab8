"""Tool calling: the fallback rendering, parsing the model's calls, streaming them as deltas, and a
round trip through the official client against a server whose model always answers with a call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from app.serving.schemas import ChatCompletionBody
from app.serving.tools import TOOL_CALL_OPEN, ToolStream, parse_output, template_messages
from tests.app.conftest import ServerThread, instant_context

WEATHER: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME: ChatCompletionToolParam = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NOT_A_TOOL = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": QUESTION, "tools": [WEATHER, TIME],
                                              **fields})


def test_the_fallback_puts_the_tools_in_the_system_message() -> None:
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    messages = template_messages(body(messages=history), template_knows_tools=False)

    assert messages[0]["role"] == "system" and '"name": "weather"' in messages[0]["content"]
    assert "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    assert template_messages(body(tool_choice="none"), template_knows_tools=False)[0]["role"] == "user"


@pytest.mark.parametrize(("text", "content", "calls"), [
    (CALL_TEXT, "Let me look.", [("weather", {"city": "Paris"})]),
    ("No call here.", "No call here.", []),
    (NOT_A_TOOL, NOT_A_TOOL, []),
    ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
     '<tool_call>{"name": "time", "arguments": {}}</tool_call>', None, [("weather", {"city": "Oslo"}), ("time", {})]),
    ('<tool_call>{"name": "weather", "arguments": {"ci', '<tool_call>{"name": "weather", "arguments": {"ci', []),
])
def test_auto_parses_calls_out_of_the_text(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    parsed_content, parsed = parse_output(body(), text)

    assert parsed_content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed] == calls
    assert all(call.id.startswith("call_") for call in parsed)


def test_required_and_named_outputs_are_parsed_from_json() -> None:
    _, required = parse_output(body(tool_choice="required"), '[{"name": "time", "parameters": {}}]')
    _, named = parse_output(body(tool_choice={"type": "function", "function": {"name": "weather"}}),
                            '{"city": "Rome"}')

    assert [(c.name, c.arguments) for c in required] == [("time", "{}")]
    assert [(c.name, c.arguments) for c in named] == [("weather", '{"city": "Rome"}')]


def test_auto_streams_the_content_before_a_call_and_the_call_at_the_end() -> None:
    stream = ToolStream(body())
    pieces = [CALL_TEXT[i:i + 5] for i in range(0, len(CALL_TEXT), 5)]
    sent = [stream.feed(piece) for piece in pieces]
    tail, deltas = stream.finish()

    assert "".join(text for text, _ in sent) + tail == "Let me look.\n"
    assert all(not text.endswith("<") for text, _ in sent)  # a possible marker start is held back
    assert all(not calls for _, calls in sent)
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(0, "weather", {"city": "Paris"})]
    assert stream.has_calls


def test_named_streams_the_arguments_as_they_come() -> None:
    stream = ToolStream(body(tool_choice={"type": "function", "function": {"name": "weather"}}))
    first = stream.feed('{"city"')
    second = stream.feed(': "Rome"}')

    assert first[1][0]["function"] == {"name": "weather", "arguments": '{"city"'} and first[1][0]["id"]
    assert second[1] == [{"index": 0, "function": {"arguments": ': "Rome"}'}}]
    assert stream.finish() == ("", [])


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_inconsistent_tool_fields_are_refused(fields: dict[str, Any], param: str) -> None:
    from app.serving.schemas import FieldRefused

    with pytest.raises(FieldRefused) as refused:
        body(**fields).check_fields()
    assert refused.value.param == param


@pytest.fixture(scope="module")
def calling_server() -> Iterator[ServerThread]:
    """A server whose model always answers with CALL_TEXT and then EOS."""
    server = ServerThread(instant_context(script=CALL_TEXT.encode())).start()
    yield server
    server.stop()


@pytest.fixture
def client(calling_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{calling_server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_a_tool_call_round_trip(client: openai.OpenAI, calling_server: ServerThread) -> None:
    first = client.chat.completions.create(model=calling_server.model_name, messages=QUESTION, tools=[WEATHER],
                                           max_tokens=200)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    history: list[ChatCompletionMessageParam] = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    second = client.chat.completions.create(model=calling_server.model_name, messages=history, tools=[WEATHER],
                                            max_tokens=200)
    prompt = calling_server.engine.submitted[-1].prompt_token_ids
    rendered = bytes(t for t in prompt if t < 256).decode()

    assert second.choices[0].message.tool_calls is not None  # this model always calls
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in rendered
    assert '"arguments": {"city": "Paris"}' in rendered


def test_tool_calls_stream_as_deltas(client: openai.OpenAI, calling_server: ServerThread) -> None:
    chunks = list(client.chat.completions.create(model=calling_server.model_name, messages=QUESTION,
                                                 tools=[WEATHER], max_tokens=200, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    assert content == "Let me look.\n"
    assert len(deltas) == 1 and deltas[0].function is not None
    assert deltas[0].function.name == "weather" and json.loads(deltas[0].function.arguments or "") == {"city": "Paris"}
    assert finishes == ["tool_calls"]


def test_tool_choice_none_leaves_the_text_alone(client: openai.OpenAI, calling_server: ServerThread) -> None:
    result = client.chat.completions.create(model=calling_server.model_name, messages=QUESTION, tools=[WEATHER],
                                            tool_choice="none", max_tokens=200)

    assert result.choices[0].message.tool_calls is None
    assert result.choices[0].message.content == CALL_TEXT
    assert TOOL_CALL_OPEN not in bytes(t for t in calling_server.engine.submitted[-1].prompt_token_ids
                                       if t < 256).decode().split("<|user|>")[0]


# ---- forced calls and structured outputs through a real model ---------------------------------------

CITY: dict[str, Any] = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"],
    "additionalProperties": False}
FORECAST: ChatCompletionToolParam = {"type": "function", "function": {"name": "forecast", "parameters": CITY}}


@pytest.fixture
def tiny_client(tiny_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_always_validates(tiny_client: openai.OpenAI, tiny_server: ServerThread,
                                                      stream: bool) -> None:
    texts = []
    for seed in range(3):
        fields: Any = {"model": tiny_server.model_name, "messages": QUESTION, "max_tokens": 80, "temperature": 1.0,
                       "seed": seed, "response_format": {"type": "json_schema", "json_schema": {
                           "name": "trip", "schema": CITY, "strict": True}}}
        if stream:
            chunks = list(tiny_client.chat.completions.create(stream=True, **fields))
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            texts.append(tiny_client.chat.completions.create(**fields).choices[0].message.content or "")
    for text in texts:
        jsonschema.validate(json.loads(text), CITY)


def test_a_schema_the_grammar_cannot_take_is_400(tiny_client: openai.OpenAI, tiny_server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        tiny_client.chat.completions.create(
            model=tiny_server.model_name, messages=QUESTION, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert refused.value.code == "invalid_schema" and refused.value.param == "response_format"


def test_required_and_named_calls_always_validate(tiny_client: openai.OpenAI, tiny_server: ServerThread) -> None:
    required = tiny_client.chat.completions.create(model=tiny_server.model_name, messages=QUESTION, max_tokens=120,
                                                   tools=[FORECAST, TIME], tool_choice="required", seed=3,
                                                   temperature=1.0, parallel_tool_calls=False)
    named = tiny_client.chat.completions.create(model=tiny_server.model_name, messages=QUESTION, max_tokens=80,
                                                tools=[FORECAST, TIME], seed=4, temperature=1.0,
                                                tool_choice={"type": "function", "function": {"name": "forecast"}})

    for result in (required, named):
        assert result.choices[0].finish_reason == "tool_calls"
        calls = result.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1
        call = calls[0]
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        if call.function.name == "forecast":
            jsonschema.validate(json.loads(call.function.arguments), CITY)
        else:
            assert call.function.name == "time" and isinstance(json.loads(call.function.arguments), dict)
        if result is named:
            assert call.function.name == "forecast"
