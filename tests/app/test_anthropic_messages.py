"""Anthropic's Messages API on real servers: the official anthropic client (create, stream, count_tokens,
tool use, its error classes), the raw event stream, errors in Anthropic's shape, pings while queued,
529 when the engine is full, and a client that leaves aborting its request."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, MessageParam, TextBlock, ToolParam, ToolUseBlock

import app.anthropic.routes as anthropic_routes
from tests.app.conftest import ServerThread, instant_context, stepped_server, wait_for
from tests.tenants_files import tenants_toml

QUESTION: list[MessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
# The client no longer has parameters for the sampling fields; the API still takes them.
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
GREEDY = {"temperature": 0}
CITY: dict[str, Any] = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"],
    "additionalProperties": False}
FORECAST: ToolParam = {"name": "forecast", "description": "The forecast for a city", "input_schema": CITY}
WEATHER: ToolParam = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SCRIPT = "Hello from the script. STOP here, then more."
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KEYS = {"alice": "fl-alice-key", "bob": "fl-bob-key", "carol": "fl-carol-key"}
TENANTS_TOML = tenants_toml(KEYS, settings={"alice": {"tokens_per_minute": 150}, "carol": {"classes": ["batch"]}})


def client_for(server: ServerThread, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0)


def text_of(message: Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, TextBlock))


def named_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The (name, payload) of each event of a complete stream, checking the framing strictly: an
    `event:` line and a `data:` line whose type is the event's name, blank-line separated."""
    assert body.endswith(b"\n\n"), body[-80:]
    events = []
    for frame in body.decode("utf-8").split("\n\n")[:-1]:
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        name, payload = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert payload["type"] == name, frame
        events.append((name, payload))
    return events


def assert_well_formed(events: list[tuple[str, dict[str, Any]]]) -> None:
    """message_start first, message_delta and message_stop last, and between them blocks numbered from
    0, each opened, given its deltas and closed before the next one opens."""
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    open_index: int | None = None
    num_blocks = 0
    for name, payload in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and payload["index"] == num_blocks
            open_index, num_blocks = payload["index"], num_blocks + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert payload["index"] == open_index
            open_index = None if name == "content_block_stop" else open_index
    assert open_index is None


def anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    """The message of an error answer, checked to be in Anthropic's shape; it is what names the field."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body.keys() == {"type", "error"} and body["type"] == "error"
    assert body["error"].keys() == {"type", "message"} and body["error"]["type"] == error_type
    message: str = body["error"]["message"]
    return message


# ---- the official client against builtin:tiny ------------------------------------------------------


@pytest.fixture
def tiny_client(tiny_server: ServerThread) -> Iterator[anthropic.Anthropic]:
    with client_for(tiny_server) as client:
        yield client


def test_create_answers_a_message(tiny_client: anthropic.Anthropic, tiny_server: ServerThread) -> None:
    message = tiny_client.messages.create(model=tiny_server.model_name, max_tokens=12, messages=QUESTION,
                                          system="Answer in one word.", metadata={"user_id": "someone"},
                                          service_tier="auto", extra_body=SAMPLING)

    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == tiny_server.model_name
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert 0 < message.usage.output_tokens <= 12
    assert message.stop_reason == "end_turn" or message.usage.output_tokens == 12
    assert message.usage.input_tokens > 0
    assert message.usage.cache_read_input_tokens is not None
    assert tiny_server.engine.submitted[-1].priority.value == "interactive"


def test_stream_matches_create(tiny_client: anthropic.Anthropic, tiny_server: ServerThread) -> None:
    fields: dict[str, Any] = {"model": tiny_server.model_name, "max_tokens": 10, "messages": QUESTION,
                              "extra_body": GREEDY}
    whole = tiny_client.messages.create(**fields)
    with tiny_client.messages.stream(**fields) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()

    assert streamed_text == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The second prompt was served from the prefix cache: the parts still add up to the prompt.
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_the_raw_stream_is_named_events_in_order(tiny_server: ServerThread) -> None:
    body = {"model": tiny_server.model_name, "max_tokens": 6, "messages": QUESTION, "stream": True}
    response = httpx.post(f"{tiny_server.base_url}/v1/messages", json=body, timeout=30)

    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = named_events(response.content)
    assert_well_formed(events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": delta["delta"]["stop_reason"], "stop_sequence": None}
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 0 < delta["usage"]["output_tokens"] <= 6
    assert [p["delta"]["type"] for name, p in events if name == "content_block_delta"] == \
        ["text_delta"] * sum(name == "content_block_delta" for name, _ in events)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_validates_against_its_schema(tiny_client: anthropic.Anthropic,
                                                        tiny_server: ServerThread, stream: bool) -> None:
    fields: dict[str, Any] = {"model": tiny_server.model_name, "max_tokens": 80, "messages": QUESTION,
                              "tools": [FORECAST, WEATHER], "tool_choice": {"type": "tool", "name": "forecast"},
                              "extra_body": GREEDY}
    if stream:
        with tiny_client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = tiny_client.messages.create(**fields)

    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert isinstance(call, ToolUseBlock) and call.name == "forecast" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict)
    jsonschema.validate(call.input, CITY)


def test_tool_choice_any_calls_one_of_the_tools(tiny_client: anthropic.Anthropic, tiny_server: ServerThread) -> None:
    message = tiny_client.messages.create(model=tiny_server.model_name, max_tokens=120, messages=QUESTION,
                                          tools=[FORECAST], extra_body=GREEDY,
                                          tool_choice={"type": "any", "disable_parallel_tool_use": True})

    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert isinstance(call, ToolUseBlock) and call.name == "forecast"
    jsonschema.validate(call.input, CITY)


def test_count_tokens_is_the_templated_prompt(tiny_client: anthropic.Anthropic, tiny_server: ServerThread) -> None:
    fields: dict[str, Any] = {"model": tiny_server.model_name, "messages": QUESTION, "system": "Be brief.",
                              "tools": [FORECAST]}
    counted = tiny_client.messages.count_tokens(**fields)
    without_tools = tiny_client.messages.count_tokens(model=tiny_server.model_name, messages=QUESTION)
    message = tiny_client.messages.create(max_tokens=2, **fields)

    assert counted.input_tokens == len(tiny_server.engine.submitted[-1].prompt_token_ids)
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert without_tools.input_tokens < counted.input_tokens


def test_a_repeated_long_prompt_is_read_from_the_prefix_cache(start_tiny_server: Callable[..., ServerThread]
                                                             ) -> None:
    server = start_tiny_server()  # its own, so that nothing else is cached
    system = "You are the assistant of a test that repeats this long system prompt to find it cached. " * 3
    fields: dict[str, Any] = {"model": server.model_name, "max_tokens": 2, "messages": QUESTION, "system": system}
    with client_for(server) as client:
        first = client.messages.create(**fields)
        second = client.messages.create(**fields)

    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens is not None and second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == first.usage.input_tokens
    assert second.usage.cache_creation_input_tokens == 0


# ---- stop reasons and tool use on a scripted model ---------------------------------------------------


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[ServerThread]:
    """A server whose model always answers SCRIPT and then EOS."""
    server = ServerThread(instant_context(script=SCRIPT.encode())).start()
    yield server
    server.stop()


@pytest.fixture
def scripted_client(scripted_server: ServerThread) -> Iterator[anthropic.Anthropic]:
    with client_for(scripted_server) as client:
        yield client


@pytest.mark.parametrize(("fields", "text", "stop_reason", "stop_sequence"), [
    ({}, SCRIPT, "end_turn", None),
    ({"max_tokens": 5}, "Hello", "max_tokens", None),
    ({"stop_sequences": ["nowhere", "STOP"]}, "Hello from the script. ", "stop_sequence", "STOP"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_reasons(scripted_client: anthropic.Anthropic, scripted_server: ServerThread, fields: dict[str, Any],
                      text: str, stop_reason: str, stop_sequence: str | None, stream: bool) -> None:
    request: dict[str, Any] = {"model": scripted_server.model_name, "max_tokens": 200, "messages": QUESTION, **fields}
    if stream:
        with scripted_client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = scripted_client.messages.create(**request)

    assert text_of(message) == text
    assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)
    if stop_reason == "max_tokens":
        assert message.usage.output_tokens == 5


@pytest.fixture(scope="module")
def calling_server() -> Iterator[ServerThread]:
    """A server whose model always answers with CALL_TEXT (a call of the weather tool) and then EOS."""
    server = ServerThread(instant_context(script=CALL_TEXT.encode())).start()
    yield server
    server.stop()


def test_a_tool_use_round_trip(calling_server: ServerThread) -> None:
    with client_for(calling_server) as client:
        first = client.messages.create(model=calling_server.model_name, max_tokens=200, messages=QUESTION,
                                       tools=[WEATHER])
        text, call = first.content
        assert isinstance(text, TextBlock) and text.text == "Let me look."
        assert isinstance(call, ToolUseBlock) and (call.name, call.input) == ("weather", {"city": "Paris"})
        assert first.stop_reason == "tool_use"

        history: list[MessageParam] = [
            *QUESTION,
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": call.id, "name": "weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ]
        client.messages.create(model=calling_server.model_name, max_tokens=200, messages=history, tools=[WEATHER])
    rendered = bytes(t for t in calling_server.engine.submitted[-1].prompt_token_ids if t < 256).decode()

    assert '"arguments": {"city": "Paris"}' in rendered
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered
    assert rendered.index("18 C, sunny") < rendered.index("And tomorrow?")


def test_a_tool_use_streams_as_input_json_deltas(calling_server: ServerThread) -> None:
    body: dict[str, Any] = {"model": calling_server.model_name, "max_tokens": 200, "messages": QUESTION,
                            "tools": [WEATHER]}
    events = named_events(httpx.post(f"{calling_server.base_url}/v1/messages", json={**body, "stream": True},
                                     timeout=30).content)

    assert_well_formed(events)
    blocks = [payload["content_block"] for name, payload in events if name == "content_block_start"]
    assert [block["type"] for block in blocks] == ["text", "tool_use"]
    assert blocks[1]["name"] == "weather" and blocks[1]["input"] == {}
    partial = "".join(p["delta"]["partial_json"] for name, p in events
                      if name == "content_block_delta" and p["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client_for(calling_server) as client, client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert isinstance(final.content[1], ToolUseBlock) and final.content[1].input == {"city": "Paris"}


def test_tool_choice_none_leaves_the_text_alone(calling_server: ServerThread) -> None:
    with client_for(calling_server) as client:
        message = client.messages.create(model=calling_server.model_name, max_tokens=200, messages=QUESTION,
                                         tools=[WEATHER], tool_choice={"type": "none"})

    assert text_of(message) == CALL_TEXT and message.stop_reason == "end_turn"


# ---- errors in Anthropic's shape --------------------------------------------------------------------


@pytest.fixture
def http(scripted_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=scripted_server.base_url, timeout=30) as client:
        yield client


def messages_body(server: ServerThread, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_name, "max_tokens": 16, "messages": QUESTION, **fields}


@pytest.mark.parametrize(("fields", "names"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]},
     "messages.0.content.1"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                                                  "signature": "x"}]},
                   {"role": "user", "content": "go on"}]}, "messages.1.content.0"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "The capital is"}]}, "messages.1"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text.text"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "forecast"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
])
def test_what_cannot_be_taken_is_a_400_naming_the_field(scripted_client: anthropic.Anthropic,
                                                        scripted_server: ServerThread, fields: dict[str, Any],
                                                        names: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:  # sent as they are, past the client's own types
        scripted_client.messages.create(model=scripted_server.model_name, max_tokens=16, messages=QUESTION,
                                        extra_body=fields)

    assert refused.value.status_code == 400
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["type"] == "invalid_request_error"
    assert refused.value.body["error"]["message"].startswith(names + ":"), refused.value.body


def test_a_body_without_max_tokens_or_not_json_is_a_400(http: httpx.Client, scripted_server: ServerThread) -> None:
    missing = http.post("/v1/messages", json={"model": scripted_server.model_name, "messages": QUESTION})
    not_json = http.post("/v1/messages", content=b"{nope")

    assert anthropic_error(missing, 400, "invalid_request_error") == "max_tokens: Field required"
    assert "not valid JSON" in anthropic_error(not_json, 400, "invalid_request_error")


def test_other_client_faults_keep_anthropics_shape(http: httpx.Client, scripted_server: ServerThread) -> None:
    limit = scripted_server.context.settings.max_body_bytes
    too_large = http.post("/v1/messages", content=b" " * (limit + 1))
    unknown_model = http.post("/v1/messages", json=messages_body(scripted_server, model="claude-nonexistent"))
    wrong_method = http.get("/v1/messages")
    no_route = http.post("/v1/messages/batches", json={})
    count_refused = http.post("/v1/messages/count_tokens", json={"model": scripted_server.model_name})

    assert str(limit) in anthropic_error(too_large, 413, "request_too_large")
    assert "claude-nonexistent" in anthropic_error(unknown_model, 404, "not_found_error")
    anthropic_error(wrong_method, 405, "invalid_request_error")
    anthropic_error(no_route, 404, "not_found_error")
    assert anthropic_error(count_refused, 400, "invalid_request_error") == "messages: Field required"
    with client_for(scripted_server) as client, pytest.raises(anthropic.NotFoundError):
        client.messages.create(**messages_body(scripted_server, model="claude-nonexistent"))


# ---- keys, classes and quotas -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS_TOML)
    server = ServerThread(instant_context(script=SCRIPT.encode(), tenants_file=str(path))).start()
    yield server
    server.stop()


def test_the_api_key_is_taken_as_anthropics_clients_send_it(tenants_server: ServerThread) -> None:
    with client_for(tenants_server, KEYS["bob"]) as client:
        assert text_of(client.messages.create(**messages_body(tenants_server))) == SCRIPT[:16]
    assert tenants_server.engine.submitted[-1].tenant_id == "bob"
    with anthropic.Anthropic(base_url=tenants_server.base_url, auth_token=KEYS["bob"], max_retries=0) as bearer:
        assert bearer.messages.count_tokens(model=tenants_server.model_name, messages=QUESTION).input_tokens > 0
    versioned = httpx.post(f"{tenants_server.base_url}/v1/messages", json=messages_body(tenants_server),
                           headers={"x-api-key": KEYS["bob"], "anthropic-version": "2023-06-01"}, timeout=30)
    assert versioned.status_code == 200


@pytest.mark.parametrize("key", [None, "fl-wrong"])
def test_a_missing_or_wrong_key_is_an_authentication_error(tenants_server: ServerThread, key: str | None) -> None:
    headers = {"x-api-key": key} if key else {}
    response = httpx.post(f"{tenants_server.base_url}/v1/messages", json=messages_body(tenants_server),
                          headers=headers, timeout=30)
    anthropic_error(response, 401, "authentication_error")
    with client_for(tenants_server, "fl-wrong") as client, pytest.raises(anthropic.AuthenticationError):
        client.messages.create(**messages_body(tenants_server))


def test_a_class_the_key_may_not_use_is_a_permission_error(tenants_server: ServerThread) -> None:
    with client_for(tenants_server, KEYS["carol"]) as client, pytest.raises(anthropic.PermissionDeniedError) as denied:
        client.messages.create(**messages_body(tenants_server))
    assert denied.value.status_code == 403


def test_a_spent_token_budget_is_a_rate_limit_error_with_retry_after(tenants_server: ServerThread) -> None:
    with client_for(tenants_server, KEYS["alice"]) as client:
        # The byte tokenizer: the templated QUESTION is 55 tokens, so 55 + 60 of alice's 150 per minute.
        client.messages.create(**messages_body(tenants_server, max_tokens=60))
        with pytest.raises(anthropic.RateLimitError) as limited:
            client.messages.create(**messages_body(tenants_server, max_tokens=60))

    assert limited.value.status_code == 429
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert isinstance(limited.value.body, dict) and limited.value.body["error"]["type"] == "rate_limit_error"


# ---- the engine full, a queue to wait in, a client that leaves, a stream that fails -------------------


def test_a_full_engine_is_529_overloaded() -> None:
    server, executor = stepped_server(max_queued_requests=1)
    body = messages_body(server, stream=True)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as http, \
                http.stream("POST", "/v1/messages", json=body) as first:
            assert next(first.iter_bytes()).startswith(b"event: message_start")  # holding the one place
            refused = http.post("/v1/messages", json=body)
            with client_for(server) as client, pytest.raises(anthropic.OverloadedError) as overloaded:
                client.messages.create(**messages_body(server))
            executor.open()
    finally:
        executor.open()
        server.stop()

    anthropic_error(refused, 529, "overloaded_error")
    assert refused.headers["retry-after"] == "1"
    assert overloaded.value.status_code == 529


def event_names(chunks: Iterator[str]) -> Iterator[str]:
    """The names of the events of a streaming response, as they arrive."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        *frames, buffer = buffer.split("\n\n")
        yield from (frame.split("\n")[0].removeprefix("event: ") for frame in frames)


def test_pings_keep_a_queued_stream_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anthropic_routes, "PING_INTERVAL_S", 0.05)
    server, executor = stepped_server()
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/messages", json=messages_body(server, stream=True),
                          timeout=30) as response:
            names = event_names(response.iter_text())
            waiting = [next(names), next(names), next(names)]  # no step has run: the request waits
            executor.open()
            rest = list(names)
    finally:
        executor.open()
        server.stop()

    assert waiting == ["message_start", "ping", "ping"]
    first_block = rest.index("content_block_start")
    assert set(rest[:first_block]) <= {"ping"} and "ping" not in rest[first_block:]  # none once tokens flow
    assert rest[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_its_request(stream: bool) -> None:
    server, executor = stepped_server()
    address = urlsplit(server.base_url)
    assert address.hostname is not None and address.port is not None
    payload = json.dumps(messages_body(server, max_tokens=900, stream=stream)).encode()
    try:
        with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            if stream:
                received = b""
                while b"text_delta" not in received:  # tokens are flowing
                    executor.allow(1)
                    received += sock.recv(65536)
            else:
                executor.step_until(lambda: server.stats()["running"] == 1, what="the request to run")
        executor.step_until(lambda: (server.stats()["requests_aborted"], server.stats()["running"],
                                     server.stats()["kv_blocks_in_use"]) == (1, 0, 0),
                            what="the request to be aborted and its KV blocks freed")
        stats = server.stats()
    finally:
        executor.open()
        server.stop()

    assert stats["requests_finished"] == 0


def test_a_system_message_among_the_others_stays_in_its_place(scripted_server: ServerThread) -> None:
    messages: list[MessageParam] = [{"role": "user", "content": "first"},
                                    {"role": "assistant", "content": [{"type": "text", "text": "reply"}]},
                                    {"role": "system", "content": "Now be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "second"}]}]
    with client_for(scripted_server) as client:
        client.messages.create(model=scripted_server.model_name, max_tokens=4, messages=messages,
                               system=[{"type": "text", "text": "Be kind."}])
    rendered = bytes(t for t in scripted_server.engine.submitted[-1].prompt_token_ids if t < 256).decode()

    assert rendered == ("<|system|>\nBe kind.\n<|user|>\nfirst\n<|assistant|>\nreply\n<|system|>\nNow be brief.\n"
                        "<|user|>\nsecond\n<|assistant|>\n")


def test_a_stream_ended_by_the_server_ends_with_an_error_event() -> None:
    server, executor = stepped_server(shutdown_grace_s=0.05)
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/messages", json=messages_body(server, stream=True),
                          timeout=30) as response:
            chunks = response.iter_bytes()
            first = next(chunks)
            server.server.request_shutdown()  # the grace period ends while the request's step is held
            wait_for(lambda: server.engine.num_unfinished == 0, what="the drain to end the request")
            executor.open()
            rest = b"".join(chunks)
    finally:
        executor.open()
        server.stop()

    events = named_events(first + rest)
    assert [name for name, _ in events] == ["message_start", "error"]
    assert events[-1][1]["error"]["type"] == "overloaded_error"
