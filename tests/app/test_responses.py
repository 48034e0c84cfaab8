"""The templated content chunk is byte-for-byte what encoding the whole object would give (line breaks escaped)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.openai.objects import ChatChunks, CompletionChunks, Envelope, StreamShape
from app.plumbing.json_lines import dumps_one_line

ENVELOPES = [Envelope("chatcmpl-1", 1700000000, "m", None), Envelope("x\"y", 1, "模型", "flex")]


def decode(chunk: bytes) -> object:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2
    return json.loads(chunk[len(b"data: "):])


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("include_usage", [False, True])
@given(text=st.text(min_size=1))
def test_chat_content_chunk_matches_the_object(envelope: Envelope, include_usage: bool, text: str) -> None:
    expected = {**envelope.fields("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}
    if include_usage:
        expected["usage"] = None

    chunk = ChatChunks(envelope, StreamShape(include_usage)).content(0, text)

    assert decode(chunk) == expected
    assert chunk == b"data: " + dumps_one_line(expected) + b"\n\n"


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("include_usage", [False, True])
@given(text=st.text(min_size=1))
def test_completion_content_chunk_matches_the_object(envelope: Envelope, include_usage: bool, text: str) -> None:
    expected = {**envelope.fields("text_completion"),
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}]}
    if include_usage:
        expected["usage"] = None

    chunk = CompletionChunks(envelope, StreamShape(include_usage)).content(0, text)

    assert chunk == b"data: " + dumps_one_line(expected) + b"\n\n"
