"""The Responses API through the official openai client, against real servers: whole and streamed
responses, structured outputs and function calls, stored responses and their continuation, background
responses, the flex tier, and refusals of what this server cannot do."""

from __future__ import annotations

import json
import os
import signal
import socket
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam, Response, ResponseFunctionToolCall, ResponseOutputMessage

from benchmarks.fake_executors import script_text
from scheduling.request import PriorityClass
from tests.app.conftest import ServerThread, instant_context, stepped_server, wait_for
from tests.app.served_process import ServedProcess
from tests.app.test_disconnect import read_until, wait_for_abort

SCRIPT = "Hello from fairlane."
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER: FunctionToolParam = {"type": "function", "name": "weather", "description": "The weather in a city",
                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                             "required": ["city"]}, "strict": False}
CITY: dict[str, Any] = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"],
    "additionalProperties": False}


def client_of(server: ServerThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def last_priority(server: ServerThread) -> PriorityClass:
    return server.engine.submitted[-1].priority


def prompt_text(server: ServerThread) -> str:
    """The last prompt the engine was given, as text (the byte tokenizer's tokens are bytes)."""
    return bytes(t for t in server.engine.submitted[-1].prompt_token_ids if t < 256).decode()


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[ServerThread]:
    """Every answer is SCRIPT, then EOS."""
    server = ServerThread(instant_context(script=SCRIPT.encode())).start()
    yield server
    server.stop()


@pytest.fixture
def client(scripted_server: ServerThread) -> Iterator[openai.OpenAI]:
    with client_of(scripted_server) as client:
        yield client


@pytest.fixture(scope="module")
def calling_server() -> Iterator[ServerThread]:
    """Every answer is CALL_TEXT (text, then a call of `weather`), then EOS."""
    server = ServerThread(instant_context(script=CALL_TEXT.encode())).start()
    yield server
    server.stop()


# ---- create ---------------------------------------------------------------------------------------


def test_a_plain_response(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    response = client.responses.create(model=scripted_server.model_name, input="Say hello.",
                                       instructions="Be brief.", metadata={"run": "1"}, temperature=0)

    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.error is None and response.incomplete_details is None
    assert response.output_text == SCRIPT
    message = response.output[0]
    assert isinstance(message, ResponseOutputMessage)
    assert message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = response.usage
    assert usage is not None and usage.output_tokens == len(SCRIPT) + 1  # and EOS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "Be brief." and response.metadata == {"run": "1"}
    assert response.temperature == 0 and response.tool_choice == "auto" and response.parallel_tool_calls
    assert prompt_text(scripted_server).endswith("<|system|>\nBe brief.\n<|user|>\nSay hello.\n<|assistant|>\n")


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    response = client.responses.create(model=scripted_server.model_name, input="Hi", max_output_tokens=5)

    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == SCRIPT[:5]
    assert isinstance(response.output[0], ResponseOutputMessage) and response.output[0].status == "incomplete"


def test_a_list_of_input_items(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    items: Any = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut",
                                                              "annotations": []}]},
        {"role": "user", "content": "Again"},
    ]
    client.responses.create(model=scripted_server.model_name, input=items)

    assert prompt_text(scripted_server).endswith(
        "<|developer|>\nAnswer in French.\n<|user|>\nHi!\n<|assistant|>\nSalut\n<|user|>\nAgain\n<|assistant|>\n")


def test_flex_runs_in_the_batch_class_and_is_echoed(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    flex = client.responses.create(model=scripted_server.model_name, input="Hi", service_tier="flex")
    assert flex.service_tier == "flex" and flex.output_text == SCRIPT
    assert last_priority(scripted_server) == PriorityClass.BATCH

    default = client.responses.create(model=scripted_server.model_name, input="Hi")
    assert default.service_tier == "default"
    assert last_priority(scripted_server) == PriorityClass.INTERACTIVE


def test_truncation_auto_drops_the_oldest_turns(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    """The server's context is 1024 tokens (bytes here): the first turn cannot stay."""
    history: Any = [{"role": "user", "content": "a" * 600}, {"role": "assistant", "content": "b" * 200},
                    {"role": "user", "content": "c" * 200}]
    fields: Any = {"model": scripted_server.model_name, "instructions": "Be brief.", "input": history,
                   "max_output_tokens": 100}
    with pytest.raises(openai.BadRequestError) as too_long:
        client.responses.create(**fields)
    truncated = client.responses.create(truncation="auto", **fields)

    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "max_output_tokens"
    assert truncated.truncation == "auto" and truncated.output_text == SCRIPT
    assert prompt_text(scripted_server).endswith(
        f"<|system|>\nBe brief.\n<|assistant|>\n{'b' * 200}\n<|user|>\n{'c' * 200}\n<|assistant|>\n")


# ---- streaming ------------------------------------------------------------------------------------

TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def test_streaming_with_the_client_helper(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    with client.responses.stream(model=scripted_server.model_name, input="Say hello.") as stream:
        events = list(stream)
        final = stream.get_final_response()

    kinds = [event.type for event in events]
    deduplicated = [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]
    assert deduplicated == TEXT_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == SCRIPT
    assert deltas[-1].snapshot == SCRIPT  # the helper accumulated the text it was sent
    assert final.output_text == SCRIPT and final.status == "completed"
    assert final.usage is not None and final.usage.output_tokens == len(SCRIPT) + 1  # and EOS
    assert client.responses.retrieve(final.id).output_text == SCRIPT  # stored once it ended


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client: openai.OpenAI,
                                                          scripted_server: ServerThread) -> None:
    with client.responses.stream(model=scripted_server.model_name, input="Hi", max_output_tokens=4) as stream:
        events = list(stream)

    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details is not None
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == SCRIPT[:4]


def test_function_calls_stream_as_items(calling_server: ServerThread) -> None:
    with client_of(calling_server) as client, client.responses.stream(
            model=calling_server.model_name, input="Weather in Paris?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()

    kinds = [event.type for event in events]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    call = final.output[-1]
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert final.output[0].type == "message" and final.output_text == "Let me look.\n"


def open_request(server: ServerThread, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST by hand (no client library that could hold the connection) and return the socket."""
    address = urlsplit(server.base_url)
    assert address.hostname is not None and address.port is not None
    payload = json.dumps(body).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall(b"POST %s HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_aborts_the_request(start_tiny_server: Callable[..., ServerThread], stream: bool) -> None:
    server = start_tiny_server()
    body = {"model": server.model_name, "input": "Tell me a long story.", "max_output_tokens": 900,
            "ignore_eos": True, "stream": stream}
    with open_request(server, "/v1/responses", body) as sock:
        if stream:
            read_until(sock, b"response.output_text.delta")  # tokens are flowing
        else:
            wait_for(lambda: server.stats()["running"] == 1, what="the request to run")

    stats = wait_for_abort(server)
    assert stats["requests_finished"] == 0


# ---- structured outputs and tools -----------------------------------------------------------------


@pytest.fixture
def tiny_client(tiny_server: ServerThread) -> Iterator[openai.OpenAI]:
    with client_of(tiny_server) as client:
        yield client


def test_text_format_json_schema_always_validates(tiny_client: openai.OpenAI, tiny_server: ServerThread) -> None:
    for seed in range(3):
        response = tiny_client.responses.create(
            model=tiny_server.model_name, input="A trip?", max_output_tokens=80, temperature=1.0,
            text={"format": {"type": "json_schema", "name": "trip", "schema": CITY, "strict": True}},
            extra_body={"seed": seed})
        jsonschema.validate(json.loads(response.output_text), CITY)
        assert response.text is not None and response.text.format is not None
        assert response.text.format.type == "json_schema"


def test_a_forced_function_call_validates(tiny_client: openai.OpenAI, tiny_server: ServerThread) -> None:
    forecast: FunctionToolParam = {"type": "function", "name": "forecast", "parameters": CITY, "strict": True}
    response = tiny_client.responses.create(model=tiny_server.model_name, input="Weather?", tools=[forecast],
                                            tool_choice={"type": "function", "name": "forecast"},
                                            max_output_tokens=80, temperature=1.0, extra_body={"seed": 4})

    calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
    assert len(calls) == 1 and calls[0].name == "forecast" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), CITY)


def test_a_required_call_streams_and_validates(tiny_client: openai.OpenAI, tiny_server: ServerThread) -> None:
    forecast: FunctionToolParam = {"type": "function", "name": "forecast", "parameters": CITY, "strict": True}
    with tiny_client.responses.stream(model=tiny_server.model_name, input="Weather?", tools=[forecast],
                                      tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                                      temperature=1.0, extra_body={"seed": 3}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()

    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    calls = [item for item in final.output if isinstance(item, ResponseFunctionToolCall)]
    assert len(calls) == 1 and calls[0].name == "forecast"
    jsonschema.validate(json.loads(calls[0].arguments), CITY)


def test_a_function_tool_round_trip(calling_server: ServerThread) -> None:
    with client_of(calling_server) as client:
        first = client.responses.create(model=calling_server.model_name, input="Weather in Paris?",
                                        tools=[WEATHER])
        call = first.output[-1]
        assert isinstance(call, ResponseFunctionToolCall) and call.status == "completed"
        assert first.output[0].type == "message" and first.output_text == "Let me look."

        # Stateless: the earlier turn sent back as input items, then the call's output.
        history: Any = [{"role": "user", "content": "Weather in Paris?"}, *[item.to_dict() for item in first.output],
                        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
        client.responses.create(model=calling_server.model_name, tools=[WEATHER], input=history)
        stateless = prompt_text(calling_server)
        # Stored: the same continuation by previous_response_id renders the same prompt.
        client.responses.create(model=calling_server.model_name, tools=[WEATHER], previous_response_id=first.id,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "18 C and sunny"}])

    assert "<tool_response>\n18 C and sunny\n</tool_response>" in stateless
    assert '"arguments": {"city": "Paris"}' in stateless
    assert prompt_text(calling_server) == stateless


# ---- stored responses -----------------------------------------------------------------------------


def test_retrieve_delete_and_input_items(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    created = client.responses.create(model=scripted_server.model_name, input="Remember me.")
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.id == created.id and retrieved.output_text == SCRIPT and retrieved.status == "completed"

    items = client.responses.input_items.list(created.id)
    assert [(item.type, item.role) for item in items.data if item.type == "message"] == [("message", "user")]

    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_store_false_keeps_nothing(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    created = client.responses.create(model=scripted_server.model_name, input="Forget me.", store=False)
    assert created.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_a_continuation_hits_the_prefix_cache(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    question = f"A question nobody asked before: {uuid.uuid4().hex} " * 2
    first = client.responses.create(model=scripted_server.model_name, input=question)
    second = client.responses.create(model=scripted_server.model_name, input="And then?",
                                     previous_response_id=first.id)

    assert first.usage is not None and second.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    # The first turn's prompt is the second's prefix: its full blocks (16 tokens) come from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
    assert second.previous_response_id == first.id
    assert f"{question}\n<|assistant|>\n{SCRIPT}\n<|user|>\nAnd then?" in prompt_text(scripted_server)
    items = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items.data] == ["message", "message", "message"]
    assert [getattr(item, "role", None) for item in items.data] == ["user", "assistant", "user"]
    newest_first = client.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in newest_first.data] == [items.data[-1].id] and newest_first.has_more


def test_continuing_an_unknown_response_is_404(client: openai.OpenAI, scripted_server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=scripted_server.model_name, input="Hi", previous_response_id="resp_nope")
    assert missing.value.body is not None and "previous_response_id" in str(missing.value.body)


# ---- background -----------------------------------------------------------------------------------


def status_of(client: openai.OpenAI, response_id: str) -> str | None:
    return client.responses.retrieve(response_id).status


def test_background_queued_then_polled_to_completion() -> None:
    server, executor = stepped_server()
    try:
        with client_of(server) as client:
            created = client.responses.create(model=server.model_name, input="Hi", background=True,
                                              max_output_tokens=8, extra_body={"ignore_eos": True})
            assert created.status == "queued" and created.background and created.output == []
            assert server.engine.submitted[-1].priority == PriorityClass.BATCH
            assert status_of(client, created.id) == "queued"  # no step has run
            executor.step_until(lambda: status_of(client, created.id) == "in_progress", "the first token")
            executor.open()
            wait_for(lambda: status_of(client, created.id) == "incomplete", what="the response to end")
            finished: Response = client.responses.retrieve(created.id)
    finally:
        executor.open()
        server.stop()
    assert finished.usage is not None and finished.usage.output_tokens == 8
    assert len(finished.output_text) == 8


def test_background_cancel_aborts_the_request() -> None:
    server, executor = stepped_server()
    try:
        with client_of(server) as client:
            created = client.responses.create(model=server.model_name, input="Hi", background=True,
                                              max_output_tokens=500)
            executor.step_until(lambda: status_of(client, created.id) == "in_progress", "the first token")
            cancelled = client.responses.cancel(created.id)
            assert cancelled.status == "cancelled"
            executor.open()
            wait_for(lambda: server.engine.num_unfinished == 0, what="the request to be aborted")
            assert status_of(client, created.id) == "cancelled"
            assert client.responses.cancel(created.id).status == "cancelled"  # again: as it is
            with pytest.raises(openai.BadRequestError):
                client.responses.cancel(client.responses.create(model=server.model_name, input="Hi").id)
            assert server.stats()["requests_aborted"] == 1
    finally:
        executor.open()
        server.stop()


@pytest.mark.slow
def test_a_background_response_survives_a_sigkill(tmp_path: Path) -> None:
    """Like Batch API items: a server killed mid-generation leaves it in progress; the next one runs it."""
    env = {**os.environ, "FAIRLANE_BATCH_DB_PATH": str(tmp_path / "fairlane.db")}
    served = ServedProcess(env).wait_ready()
    try:
        with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0) as client:
            created = client.responses.create(model="builtin:tiny", input="Tell me a story.", background=True,
                                              max_output_tokens=900, extra_body={"ignore_eos": True})
            wait_for(lambda: status_of(client, created.id) == "in_progress", timeout=60, what="the first token")
            assert status_of(client, created.id) == "in_progress"  # 899 tokens to go: far from done
    finally:
        served.kill()
    served = ServedProcess(env).wait_ready()
    try:
        with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0) as client:
            wait_for(lambda: status_of(client, created.id) == "incomplete", timeout=300, what="the run after")
            finished = client.responses.retrieve(created.id)
    finally:
        served.process.send_signal(signal.SIGTERM)
        served.process.wait(timeout=30)
    assert finished.created_at == created.created_at and finished.background
    assert finished.usage is not None and finished.usage.output_tokens == 900


def test_a_background_response_preempted_by_interactive_traffic_still_ends_right() -> None:
    """8 KV blocks of 16 tokens: the background response holds most of them when an interactive
    request arrives, so it is preempted (recomputed later) and then runs to its full length."""
    server, executor = stepped_server(kv_cache_bytes=8 * 1024)
    try:
        with client_of(server) as client, ThreadPoolExecutor(1) as pool:
            background = client.responses.create(model=server.model_name, input="Go on for a while.",
                                                 background=True, max_output_tokens=80,
                                                 extra_body={"ignore_eos": True})
            executor.step_until(lambda: server.stats()["kv_blocks_in_use"] >= 6, "the background response to grow")
            interactive = pool.submit(client.responses.create, model=server.model_name, input="x" * 40,
                                      max_output_tokens=8, extra_body={"ignore_eos": True})
            wait_for(lambda: server.stats()["waiting"] == 1, what="the interactive request to queue")
            executor.open()
            assert interactive.result(timeout=30).status == "incomplete"
            wait_for(lambda: status_of(client, background.id) == "incomplete", what="the background response")
            finished = client.responses.retrieve(background.id)
            preemptions = server.stats()["preemptions"]
    finally:
        executor.open()
        server.stop()
    assert sum(preemptions.values()) >= 1, preemptions
    assert finished.usage is not None and finished.usage.output_tokens == 80
    assert finished.output_text == script_text(80)  # no token lost or repeated by the preemption


# ---- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True, "store": False}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"temperature": 3}, "temperature"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client: openai.OpenAI, scripted_server: ServerThread,
                                                           fields: dict[str, Any], param: str) -> None:
    body = {"model": scripted_server.model_name, "input": "Hi", **fields}
    response = httpx.post(f"{scripted_server.base_url}/v1/responses", json=body, timeout=30)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error.keys() == {"message", "type", "param", "code"}


def test_an_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="Hi")
    assert missing.value.code == "model_not_found"
