"""Explicit cache breakpoints (`cache_control`) on real servers: the Messages API reports the prompt's
breakpoint as written the first time and read the next, its three input counts adding up to the prompt;
chat completions take marks on messages and on their text parts; the engine request carries the pin;
a malformed mark is a 400 in each API's own error shape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import MessageParam, TextBlockParam, ToolParam

from gpu.tokenizer import ByteTokenizer
from scheduling.request import Request
from tests.app.conftest import ServerThread, instant_context
from tests.app.test_anthropic_messages import client_for, named_events

BLOCK_SIZE = 16  # of both test engines (tests/app/conftest.py)
# Long enough to fill several blocks with the byte tokenizer of both test models (a token per byte).
SYSTEM = "You are the assistant of a test that marks this long system prompt as a cache breakpoint. " * 3
QUESTION: list[MessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
MARKED_SYSTEM: list[TextBlockParam] = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def instant_server() -> Iterator[ServerThread]:
    """Its own: the pins these tests make stay out of the shared servers' caches."""
    server = ServerThread(instant_context()).start()
    yield server
    server.stop()


def last_request(server: ServerThread) -> Request:
    return server.engine.submitted[-1]


def pinned_text(request: Request) -> str:
    """The text of the request's pinned prefix (both test models have the byte tokenizer). The prefix
    rendered alone is followed by the assistant's turn, the whole prompt by the next message: they share
    what the template writes alike there, the `<|` that opens any turn, all of `<|assistant|>\n` before
    an assistant's message."""
    return ByteTokenizer().decode(request.prompt_token_ids[:request.cache_pin_tokens])


def chat(server: ServerThread, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {"model": server.model_name, "messages": messages, "max_tokens": 2, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)


# ---- the Messages API: written, then read ------------------------------------------------------------


def test_a_system_breakpoint_is_written_then_read(start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()  # its own, so that nothing else is cached
    fields: dict[str, Any] = {"model": server.model_name, "max_tokens": 2, "messages": QUESTION,
                              "system": MARKED_SYSTEM}
    with client_for(server) as client:
        num_prompt_tokens = client.messages.count_tokens(model=server.model_name, messages=QUESTION,
                                                         system=MARKED_SYSTEM).input_tokens
        first = client.messages.create(**fields)
        pinned = server.engine.scheduler.pins.pinned_by(last_request(server).tenant_id)
        second = client.messages.create(**fields)

    request = last_request(server)
    assert 0 < request.cache_pin_tokens < num_prompt_tokens and request.cache_pin_ttl_s == 300.0
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens == request.cache_pin_tokens // BLOCK_SIZE * BLOCK_SIZE > 0
    assert pinned == request.cache_pin_tokens // BLOCK_SIZE
    assert second.usage.cache_read_input_tokens is not None and second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_creation_input_tokens == 0
    for usage in (first.usage, second.usage):
        assert usage.input_tokens > 0
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + \
            (usage.cache_creation_input_tokens or 0) == num_prompt_tokens


def test_the_stream_reports_the_breakpoint_as_the_whole_message_does(
        start_tiny_server: Callable[..., ServerThread]) -> None:
    server = start_tiny_server()
    body = {"model": server.model_name, "max_tokens": 2, "messages": QUESTION, "system": MARKED_SYSTEM,
            "stream": True}
    streams = [httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60) for _ in range(2)]

    num_prompt_tokens = len(last_request(server).prompt_token_ids)
    (first_start, first_end), (second_start, second_end) = [
        (events[0][1]["message"]["usage"], events[-2][1]["usage"])
        for events in (named_events(stream.content) for stream in streams)]
    for usage in (first_start, first_end, second_start, second_end):
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] \
            == num_prompt_tokens
    # Written the first time, from the start on; read the second time, known once the prompt has run.
    assert first_start == {**first_end, "output_tokens": first_start["output_tokens"]}
    assert first_end["cache_creation_input_tokens"] > 0 and first_end["cache_read_input_tokens"] == 0
    assert second_end["cache_creation_input_tokens"] == 0 and second_end["cache_read_input_tokens"] > 0


def test_marks_land_where_the_template_renders_them(instant_server: ServerThread) -> None:
    """A tool's mark keeps the system area, the top-level mark the whole conversation, a 1h TTL an hour."""
    tool: ToolParam = {"name": "weather", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    two_turns: list[MessageParam] = [{"role": "user", "content": "First question."},
                                     {"role": "assistant", "content": "An answer."},
                                     {"role": "user", "content": "And a second one?"}]
    base: dict[str, Any] = {"model": instant_server.model_name, "max_tokens": 2, "messages": two_turns}
    with client_for(instant_server) as client:
        client.messages.create(**base, tools=[tool])
        by_tool = last_request(instant_server)
        client.messages.create(**base, cache_control={"type": "ephemeral", "ttl": "1h"})
        by_top = last_request(instant_server)

    # No system message: the tools go in the one the fallback template opens, the mark on the first message.
    assert pinned_text(by_tool).startswith("<|system|>\n") and "weather" in pinned_text(by_tool)
    assert pinned_text(by_tool).endswith("\n<|user|>\nFirst question.\n<|assistant|>\n")
    assert by_tool.cache_pin_ttl_s == 300.0
    assert by_top.cache_pin_tokens == len(by_top.prompt_token_ids) and by_top.cache_pin_ttl_s == 3600.0


def test_no_mark_no_pin_and_nothing_written(instant_server: ServerThread) -> None:
    with client_for(instant_server) as client:
        message = client.messages.create(model=instant_server.model_name, max_tokens=2, messages=QUESTION,
                                         system=SYSTEM)

    assert last_request(instant_server).cache_pin_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0


@pytest.mark.parametrize("control", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"}])
def test_a_bad_mark_is_anthropics_400(instant_server: ServerThread, control: dict[str, Any]) -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": control}]
    response = httpx.post(f"{instant_server.base_url}/v1/messages", timeout=30, json={
        "model": instant_server.model_name, "max_tokens": 2, "messages": QUESTION, "system": system})

    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("system.0.cache_control.")


def test_more_than_four_marks_are_anthropics_400(instant_server: ServerThread) -> None:
    blocks: list[TextBlockParam] = [{"type": "text", "text": f"part {index}", "cache_control": {"type": "ephemeral"}}
                                    for index in range(5)]
    with client_for(instant_server) as client, pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=instant_server.model_name, max_tokens=2,
                               messages=[{"role": "user", "content": blocks}])

    assert "A maximum of 4 blocks with cache_control" in refused.value.message


# ---- chat completions --------------------------------------------------------------------------------


def test_a_mark_on_a_chat_part_pins_the_prompt_through_its_message(start_tiny_server: Callable[..., ServerThread]
                                                                   ) -> None:
    server = start_tiny_server()
    system = {"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]}
    messages: list[Any] = [system, {"role": "user", "content": "What is the capital of France?"}]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        first = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=2)
        request = last_request(server)
        pinned = server.engine.scheduler.pins.pinned_by(request.tenant_id)
        second = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=2)

    assert pinned_text(request) == f"<|system|>\n{SYSTEM}\n<|" and request.cache_pin_ttl_s == 300.0
    assert pinned == request.cache_pin_tokens // BLOCK_SIZE > 0
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= request.cache_pin_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_a_mark_on_a_chat_message_of_any_shape(instant_server: ServerThread) -> None:
    """On a message itself, with a TTL; the last marked message is the breakpoint."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM, "cache_control": EPHEMERAL},
        {"role": "user", "content": "A question.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "assistant", "content": "An answer."}, {"role": "user", "content": "Another?"}]
    response = chat(instant_server, messages)

    assert response.status_code == 200, response.text
    request = last_request(instant_server)
    assert pinned_text(request) == f"<|system|>\n{SYSTEM}\n<|user|>\nA question.\n<|assistant|>\n"
    assert request.cache_pin_ttl_s == 3600.0


def test_every_choice_carries_the_pin(instant_server: ServerThread) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]}]
    response = chat(instant_server, messages, n=3)

    assert response.status_code == 200, response.text
    pins = {(r.cache_pin_tokens, r.cache_pin_ttl_s) for r in instant_server.engine.submitted[-3:]}
    assert pins == {(len(last_request(instant_server).prompt_token_ids), 300.0)}


@pytest.mark.parametrize(("control", "where"), [
    ({"type": "persistent"}, "cache_control.type"),
    ({"type": "ephemeral", "ttl": "2h"}, "cache_control.ttl"),
    ({"type": "ephemeral", "scope": "global"}, "cache_control.scope"),
])
@pytest.mark.parametrize("on_part", [True, False])
def test_a_bad_chat_mark_is_openais_400(instant_server: ServerThread, control: dict[str, Any], where: str,
                                        on_part: bool) -> None:
    message: dict[str, Any] = {"role": "user", "content": "Hello"}
    if on_part:
        message["content"] = [{"type": "text", "text": "Hello", "cache_control": control}]
    else:
        message["cache_control"] = control
    response = chat(instant_server, [message])

    assert response.status_code == 400
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    param = "messages.0.content.0.cache_control" if on_part else "messages.0.cache_control"
    assert error["param"] == param and f"messages.0.{'content.0.' if on_part else ''}{where}" in error["message"]


def test_more_than_four_chat_marks_are_a_400(instant_server: ServerThread) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL}
                                             for i in range(5)]}]
    response = chat(instant_server, messages)

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
