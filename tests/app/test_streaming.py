"""SSE framing, incremental detokenization and stop strings, read raw off a real server.

The instant executor streams a known UTF-8 script one byte per token, so every multi-byte
character crosses token boundaries and the expected text is known exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from benchmarks.fake_executors import script_text
from scheduling.request import PriorityClass, RequestStatus
from tests.app.conftest import ServerThread, wait_for
from tests.app.sse import finish_reasons, sse_payloads, streamed_text

NUM_TOKENS = 100  # ends on a whole character: the script's multi-byte ones are all inside


@pytest.fixture
def http(instant_server: ServerThread) -> Iterator[httpx.Client]:
    with instant_server.in_process_client(timeout=30) as client:
        yield client


def chat_body(server: ServerThread, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_name, "messages": [{"role": "user", "content": "Say something."}], **fields}


def stream_chat(http: httpx.Client, server: ServerThread, **fields: Any) -> tuple[httpx.Response, list[dict[str, Any]]]:
    response = http.post("/v1/chat/completions", json=chat_body(server, stream=True, **fields))
    assert response.status_code == 200, response.text
    return response, sse_payloads(response.content)


def test_chat_stream_has_openai_framing(http: httpx.Client, instant_server: ServerThread) -> None:
    response, payloads = stream_chat(http, instant_server, max_tokens=NUM_TOKENS,
                                     stream_options={"include_usage": True})

    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    first, usage = payloads[0], payloads[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {(p["id"], p["object"], p["created"], p["model"]) for p in payloads} == {
        (first["id"], "chat.completion.chunk", first["created"], instant_server.model_name)}
    assert first["id"].startswith("chatcmpl-")
    assert all(p["usage"] is None for p in payloads[:-1])
    assert usage["choices"] == []
    prompt_tokens = usage["usage"]["prompt_tokens"]
    assert usage["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": NUM_TOKENS,
                              "total_tokens": prompt_tokens + NUM_TOKENS,
                              "prompt_tokens_details": {"cached_tokens": usage["usage"]["prompt_tokens_details"]
                                                        ["cached_tokens"]}}
    assert finish_reasons(payloads) == ["length"]
    assert payloads[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_stream_without_include_usage_has_no_usage(http: httpx.Client, instant_server: ServerThread) -> None:
    _, payloads = stream_chat(http, instant_server, max_tokens=5, stream_options={"include_obfuscation": False})

    assert all("usage" not in payload and payload["choices"] for payload in payloads)


def test_streamed_text_never_splits_a_character(http: httpx.Client, instant_server: ServerThread) -> None:
    _, payloads = stream_chat(http, instant_server, max_tokens=NUM_TOKENS)
    deltas = [p["choices"][0]["delta"].get("content", "") for p in payloads]

    assert "".join(deltas) == script_text(NUM_TOKENS)
    assert not any("\ufffd" in delta for delta in deltas)
    assert {"é", "你", "🙂"} <= set(deltas)  # each came as its own delta, whole, though it spans tokens


def test_a_character_cut_by_max_tokens_ends_as_a_replacement_char(http: httpx.Client,
                                                                  instant_server: ServerThread) -> None:
    _, payloads = stream_chat(http, instant_server, max_tokens=80)

    assert streamed_text(payloads) == script_text(80)
    assert streamed_text(payloads).endswith("，\ufffd")


def test_completion_stream_framing(http: httpx.Client, instant_server: ServerThread) -> None:
    response = http.post("/v1/completions", json={"model": instant_server.model_name, "prompt": ["Once"],
                                                  "max_tokens": 12, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    payloads = sse_payloads(response.content)

    assert all(p["object"] == "text_completion" and p["id"].startswith("cmpl-") for p in payloads)
    assert streamed_text(payloads) == script_text(12)
    assert payloads[-2]["choices"] == [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert payloads[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize(("stop", "expected"), [
    ("fox", "The quick brown "),  # spans three tokens
    (["lazy", "quick"], "The "),  # the earliest match wins, whatever the list order
    ("世界", "The quick brown fox jumps over the lazy dog. Déjà vu, naïve café; 你好，"),  # inside characters
    ("dog!", script_text(NUM_TOKENS)),  # "dog" is held back, then released when "." shows it is no stop
])
def test_stop_strings_across_token_boundaries(http: httpx.Client, instant_server: ServerThread,
                                              stop: str | list[str], expected: str) -> None:
    _, payloads = stream_chat(http, instant_server, max_tokens=NUM_TOKENS, stop=stop)

    assert streamed_text(payloads) == expected
    assert finish_reasons(payloads) == (["length"] if stop == "dog!" else ["stop"])


def test_a_stop_string_ends_the_engine_request_as_stopped(http: httpx.Client,
                                                          instant_server: ServerThread) -> None:
    response = http.post("/v1/completions", json={"model": instant_server.model_name, "prompt": "x",
                                                  "max_tokens": 500, "stop": "jumps"})
    request = instant_server.engine.submitted[-1]

    assert response.json()["choices"][0] == {"text": "The quick brown fox ", "index": 0, "logprobs": None,
                                             "finish_reason": "stop"}
    wait_for(lambda: request.status.is_finished, what="the engine to end the request")
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.num_output_tokens < 500


def test_non_streaming_chat_completion(http: httpx.Client, instant_server: ServerThread) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(instant_server, max_tokens=NUM_TOKENS,
                                                                service_tier="flex"))
    body = response.json()

    assert response.status_code == 200
    assert body["object"] == "chat.completion"
    assert body["service_tier"] == "flex"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": script_text(NUM_TOKENS)},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == NUM_TOKENS
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_repeated_prompt_reports_cached_tokens(http: httpx.Client, instant_server: ServerThread) -> None:
    body = {"model": instant_server.model_name, "prompt": "A shared preamble, long enough for blocks. " * 3,
            "max_tokens": 2}
    http.post("/v1/completions", json=body)
    usage = http.post("/v1/completions", json=body).json()["usage"]

    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16


@pytest.mark.parametrize(("tier", "priority"), [
    (None, PriorityClass.INTERACTIVE), ("auto", PriorityClass.INTERACTIVE), ("default", PriorityClass.INTERACTIVE),
    ("flex", PriorityClass.BATCH), ("batch", PriorityClass.BATCH)])
def test_service_tier_picks_the_priority_class(http: httpx.Client, instant_server: ServerThread,
                                               tier: str | None, priority: PriorityClass) -> None:
    fields = {} if tier is None else {"service_tier": tier}
    _, payloads = stream_chat(http, instant_server, max_tokens=2, **fields)

    assert instant_server.engine.submitted[-1].priority is priority
    assert all(payload.get("service_tier") == tier for payload in payloads)


def test_a_batch_class_stream_sends_its_tokens_by_the_interval(http: httpx.Client,
                                                                 instant_server: ServerThread) -> None:
    interval = instant_server.context.settings.batch_stream_interval
    _, payloads = stream_chat(http, instant_server, max_tokens=NUM_TOKENS, service_tier="flex")

    contents = [c["delta"]["content"] for p in payloads for c in p["choices"] if c["delta"].get("content")]
    assert instant_server.engine.submitted[-1].stream_interval == interval > 1
    assert "".join(contents) == script_text(NUM_TOKENS)
    assert contents[0] == script_text(1)  # the first token is not held
    assert len(contents) <= 1 + -(-(NUM_TOKENS - 1) // interval)


@pytest.mark.parametrize(("fields", "interval"), [
    ({}, 1), ({"service_tier": "flex", "stop": ["never in the script"]}, 1)])
def test_interactive_streams_and_stop_strings_send_each_token(http: httpx.Client, instant_server: ServerThread,
                                                              fields: dict[str, Any], interval: int) -> None:
    stream_chat(http, instant_server, max_tokens=4, **fields)

    assert instant_server.engine.submitted[-1].stream_interval == interval


def test_sampling_fields_reach_the_engine(http: httpx.Client, instant_server: ServerThread) -> None:
    http.post("/v1/chat/completions", json=chat_body(instant_server, max_completion_tokens=3, max_tokens=9,
                                                     temperature=0.5, top_p=0.25, seed=-3, ignore_eos=True))
    request = instant_server.engine.submitted[-1]

    assert request.max_tokens == 3  # max_completion_tokens wins over max_tokens
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.5, 0.25, -3)
    assert request.stop_token_ids == frozenset()


def test_defaults_reach_the_engine(http: httpx.Client, instant_server: ServerThread) -> None:
    settings = instant_server.context.settings
    max_model_len = instant_server.context.geometry.max_model_len
    http.post("/v1/completions", json={"model": instant_server.model_name, "prompt": "hi"})
    short = instant_server.engine.submitted[-1]
    http.post("/v1/completions", json={"model": instant_server.model_name, "prompt": "x" * (max_model_len - 10)})
    long = instant_server.engine.submitted[-1]

    assert short.max_tokens == settings.default_max_tokens
    assert long.max_tokens == 10  # the rest of the context
    assert (short.sampling.temperature, short.sampling.top_p, short.sampling.seed) == (1.0, 1.0, None)
    assert short.stop_token_ids == instant_server.context.tokenizer.eos_token_ids


def test_request_id_is_echoed_or_generated(http: httpx.Client) -> None:
    echoed = http.get("/health", headers={"x-request-id": "client-id-42"})
    generated = http.get("/v1/models")
    unusable = http.get("/v1/models", headers={"x-request-id": "x" * 500})

    assert echoed.headers["x-request-id"] == "client-id-42"
    assert len(generated.headers["x-request-id"]) == 32
    assert unusable.headers["x-request-id"] != "x" * 500
    assert http.get("/nowhere").headers["x-request-id"]


def test_health_and_stats(http: httpx.Client) -> None:
    health = http.get("/health")
    stats = http.get("/stats").json()

    assert (health.status_code, health.json()["ready"]) == (200, True)
    assert {"running", "waiting", "swapped", "kv_blocks_in_use", "kv_blocks_total", "requests_finished",
            "requests_aborted"} <= stats.keys()
