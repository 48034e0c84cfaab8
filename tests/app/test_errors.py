"""Every client mistake is a 4xx in OpenAI's error shape; overload and shutdown are 503s."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any

import httpx
import pytest

from gpu.tokenizer import ByteTokenizer, ChatMessage
from tests.app.conftest import ServerThread, instant_context, stepped_server


@pytest.fixture
def http(instant_server: ServerThread) -> Iterator[httpx.Client]:
    with instant_server.in_process_client(timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None,
                 says: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert says in error["message"]
    return error


def chat(server: ServerThread, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"model": "x",}', b"\xff\xfe"])
def test_malformed_json_is_400(http: httpx.Client, raw: bytes) -> None:
    response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})

    assert_error(response, 400, code="invalid_json", says="not valid JSON")


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"messages": None}, "messages", ""),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", ""),
    ({"model": 7}, "model", "valid string"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 1.5}, "max_tokens", "valid integer"),
    ({"max_tokens": "10"}, "max_tokens", "valid integer"),
    ({"max_completion_tokens": -1}, "max_completion_tokens", ""),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": -0.1}, "temperature", ""),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.01}, "top_p", ""),
    ({"seed": 2**64}, "seed", ""),
    ({"n": 65}, "n", "less than or equal to 64"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings"),
    ({"stop": ""}, "stop", ""),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"stream_options": {"include_usage": 1}}, "stream_options", ""),
    ({"service_tier": "gold"}, "service_tier", ""),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream' is enabled"),
    ({"logit_bias": {"x": 2}}, "logit_bias", "keys are token ids"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "less than or equal to 100"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "below the vocabulary size"),
    ({"stop_token_ids": [99999999]}, "stop_token_ids", "below the vocabulary size"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": "0"}, "frequency_penalty", "valid number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_p": 1.5}, "min_p", ""),
    ({"top_k": -2}, "top_k", ""),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "must not exceed max_tokens"),
    ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs' set to true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "needs content"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages", "tool_call_id"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given"),
    ({"response_format": {"type": "yaml"}}, "response_format", ""),
])
def test_invalid_fields_are_400_naming_the_field(http: httpx.Client, instant_server: ServerThread,
                                                 fields: dict[str, Any], param: str, says: str) -> None:
    response = http.post("/v1/chat/completions", json=chat(instant_server, **fields))

    assert_error(response, 400, param=param, says=says)


def test_missing_model_is_400(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi"})

    assert_error(response, 400, param="model", says="model")


def test_a_json_array_body_is_400(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json=[1, 2]), 400, says="Input should be an object")


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"store": True}, "store", "not stored"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "does not reason"),
    ({"web_search_options": {}}, "web_search_options", "search the web"),
    ({"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
    ({"priority": 3}, "priority", "service_tier"),
    ({"skip_special_tokens": False}, "skip_special_tokens", ""),
    ({"continue_final_message": True}, "continue_final_message", ""),
])
def test_what_the_server_cannot_do_is_400_unsupported(http: httpx.Client, instant_server: ServerThread,
                                                      fields: dict[str, Any], param: str, says: str) -> None:
    response = http.post("/v1/chat/completions", json=chat(instant_server, **fields))

    assert_error(response, 400, param=param, code="unsupported_value", says=says)


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"suffix": "}"}, "suffix", "fill in the middle"),
    ({"best_of": 3, "n": 2, "stream": True}, "best_of", "cannot be streamed"),
])
def test_completions_fields_the_server_cannot_do_are_400(http: httpx.Client, instant_server: ServerThread,
                                                         fields: dict[str, Any], param: str, says: str) -> None:
    body = {"model": instant_server.model_name, "prompt": "hi", **fields}

    assert_error(http.post("/v1/completions", json=body), 400, param=param, code="unsupported_value", says=says)


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"best_of": 1, "n": 2}, "best_of", "at least n"),
    ({"prompt": [1, 2, 99999999]}, "prompt", "below the vocabulary size"),
    ({"prompt": []}, "prompt", ""),
    ({"prompt": [[]]}, "prompt", ""),
    ({"prompt": ["a"] * 65}, "prompt", ""),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
])
def test_bad_completions_fields_are_400(http: httpx.Client, instant_server: ServerThread,
                                        fields: dict[str, Any], param: str, says: str) -> None:
    body = {"model": instant_server.model_name, "prompt": "hi", **fields}

    assert_error(http.post("/v1/completions", json=body), 400, param=param, says=says)


def test_a_prompt_too_long_for_the_context_says_the_numbers(http: httpx.Client,
                                                             instant_server: ServerThread) -> None:
    max_model_len = instant_server.context.geometry.max_model_len
    response = http.post("/v1/completions", json={"model": instant_server.model_name,
                                                  "prompt": "x" * (max_model_len - 50), "max_tokens": 100})

    error = assert_error(response, 400, param="max_tokens", code="context_length_exceeded")
    assert f"{max_model_len - 50}" in error["message"] and f"{max_model_len}" in error["message"]


def test_a_prompt_that_fills_the_context_is_400(http: httpx.Client, instant_server: ServerThread) -> None:
    max_model_len = instant_server.context.geometry.max_model_len
    response = http.post("/v1/completions", json={"model": instant_server.model_name, "prompt": "x" * max_model_len})

    assert_error(response, 400, param="prompt", code="context_length_exceeded")


def test_unknown_model_is_404(http: httpx.Client, instant_server: ServerThread) -> None:
    response = http.post("/v1/chat/completions", json=chat(instant_server, model="gpt-17"))

    assert_error(response, 404, param="model", code="model_not_found", says="gpt-17")
    assert_error(http.get("/v1/models/gpt-17"), 404, param="model", code="model_not_found")


def test_unknown_route_is_404_and_wrong_method_405(http: httpx.Client) -> None:
    assert_error(http.get("/v1/engines"), 404, code="not_found")
    wrong_method = http.get("/v1/chat/completions")

    assert_error(wrong_method, 405, code="method_not_allowed")
    assert wrong_method.headers["allow"] == "POST"


def test_body_over_the_limit_is_413_by_content_length(http: httpx.Client, instant_server: ServerThread) -> None:
    limit = instant_server.context.settings.max_body_bytes
    response = http.post("/v1/completions", content=b"x" * (limit + 1))

    assert_error(response, 413, code="request_too_large", says=str(limit))


def test_body_over_the_limit_is_413_while_streaming_in(instant_server: ServerThread) -> None:
    limit = instant_server.context.settings.max_body_bytes

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked, over the socket
        for _ in range(limit // 1024 + 2):
            yield b" " * 1024

    with httpx.Client(base_url=instant_server.base_url, timeout=30) as http:
        assert_error(http.post("/v1/completions", content=chunks()), 413, code="request_too_large")


def test_overload_is_503_with_retry_after() -> None:
    """The first request holds the one place for as long as the test holds its steps (on a real model a
    loaded machine let it finish before the second arrived)."""
    server, executor = stepped_server(max_queued_requests=1)
    body = {"model": server.model_name, "prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as first:
                executor.allow(1)  # its first token; the next step is held
                next(first.iter_bytes())  # running, and holding the one place
                refused = http.post("/v1/completions", json=body)
                executor.open()
            assert_error(refused, 503, code="server_overloaded")
            assert refused.headers["retry-after"] == "1"
    finally:
        executor.open()
        server.stop()


class AlternatingRolesTokenizer(ByteTokenizer):
    """A chat template like many real ones: it raises unless user and assistant alternate."""

    def encode_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
                    ) -> list[int]:
        roles = [message["role"] for message in messages]
        if any(a == b for a, b in pairwise(roles)):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return super().encode_chat(messages, tools)


def test_a_chat_template_that_refuses_the_messages_is_400() -> None:
    context = instant_context()
    context.tokenizer = AlternatingRolesTokenizer()
    server = ServerThread(context).start()
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    try:
        response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10,
                              json={"model": server.model_name, "messages": messages})
    finally:
        server.stop()

    assert_error(response, 400, param="messages", says="roles must alternate")
