"""The official openai client, sync and async, streaming and not, against a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from openai.types.completion_usage import CompletionUsage

from tests.app.conftest import ServerThread

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(tiny_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
async def async_client(tiny_server: ServerThread) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                                  max_retries=0) as client:
        yield client


def assert_usage(usage: CompletionUsage | None, completion_tokens: int) -> None:
    assert usage is not None
    assert usage.completion_tokens == completion_tokens
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_lists_the_served_model(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    assert [model.id for model in client.models.list()] == [tiny_server.model_name]
    assert client.models.retrieve(tiny_server.model_name).id == tiny_server.model_name


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    whole = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=tiny_server.model_name, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))

    assert whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == "length"
    assert_usage(whole.usage, 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.id == chunks[0].id and chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == []
    assert_usage(chunks[-1].usage, 12)


def test_completion_streaming_and_not(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    whole = client.completions.create(model=tiny_server.model_name, prompt="Once upon a time", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=tiny_server.model_name, prompt="Once upon a time",
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))

    assert whole.object == "text_completion"
    assert_usage(whole.usage, 8)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices == []
    assert_usage(chunks[-1].usage, 8)


async def test_async_client_streams_chat(async_client: openai.AsyncOpenAI, tiny_server: ServerThread) -> None:
    stream = await async_client.chat.completions.create(
        model=tiny_server.model_name, messages=MESSAGES, max_completion_tokens=6, temperature=0.8, seed=7,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks: list[ChatCompletionChunk] = [chunk async for chunk in stream]

    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert_usage(chunks[-1].usage, 6)


async def test_async_client_non_streaming_is_reproducible_with_a_seed(async_client: openai.AsyncOpenAI,
                                                                      tiny_server: ServerThread) -> None:
    async def sample() -> str | None:
        result = await async_client.chat.completions.create(
            model=tiny_server.model_name, messages=MESSAGES, max_tokens=10, temperature=1.0, top_p=0.9, seed=1234,
            extra_body={"ignore_eos": True})
        return result.choices[0].message.content

    assert await sample() == await sample()


def test_client_errors_surface_as_openai_exceptions(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as bad_request:
        client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, temperature=3)

    assert not_found.value.code == "model_not_found"
    assert bad_request.value.param == "temperature"


def test_a_near_zero_temperature_decodes_greedily(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    def answer(temperature: float) -> str | None:
        result = client.completions.create(model=tiny_server.model_name, prompt="Tell me", max_tokens=8,
                                           temperature=temperature, extra_body={"ignore_eos": True})
        return result.choices[0].text

    assert answer(1e-30) == answer(0.0)  # 1/temperature would overflow the logits: greedy instead
