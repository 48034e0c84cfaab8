"""A generated text holding U+0085, U+2028 or U+2029 never splits a streamed line.

JSON leaves the three raw, and readers that split lines as Python's `str.splitlines` does (httpx's
`iter_lines` among them) take them as line ends. Every endpoint that streams, read line by line that
way off a real server, must still give whole `data:` lines of JSON and the exact text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.batch.finish import dump_line
from tests.app.conftest import ServerThread, instant_context

SCRIPT = "one\u0085two\u2028three\u2029four"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    server = ServerThread(instant_context(script=SCRIPT.encode())).start()
    yield server
    server.stop()


def data_lines(server: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each `data:` payload of the stream, read with httpx's line splitting; fails on a line not JSON."""
    payloads = []
    with httpx.Client(base_url=server.base_url, timeout=30) as client, \
            client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            assert line == "" or line.startswith(("data: ", "event: ")), repr(line)
            if line.startswith("data: ") and line != "data: [DONE]":
                payloads.append(json.loads(line.removeprefix("data: ")))
    return payloads


MESSAGES = [{"role": "user", "content": "Say it."}]


def test_chat_completion_chunks_stay_whole(server: ServerThread) -> None:
    payloads = data_lines(server, "/v1/chat/completions",
                          {"model": server.model_name, "messages": MESSAGES, "stream": True})
    text = "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    assert text == SCRIPT


def test_anthropic_message_events_stay_whole(server: ServerThread) -> None:
    payloads = data_lines(server, "/v1/messages",
                          {"model": server.model_name, "max_tokens": 100, "messages": MESSAGES, "stream": True})
    text = "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta")
    assert text == SCRIPT


def test_responses_events_stay_whole(server: ServerThread) -> None:
    payloads = data_lines(server, "/v1/responses", {"model": server.model_name, "input": "Say it.", "stream": True})
    text = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert text == SCRIPT


def test_a_batch_output_line_stays_one_line() -> None:
    line = dump_line({"text": SCRIPT})
    assert line.splitlines() == [line]
    assert json.loads(line) == {"text": SCRIPT}
