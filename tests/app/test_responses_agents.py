"""The openai-agents SDK, unchanged, runs an agent with a function tool through /v1/responses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Literal

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from pydantic import BaseModel

from tests.app.conftest import MiB, ServerThread


class Forecast(BaseModel):
    """The agent's final answer: a structured output, so the random tiny model ends it (the grammar
    leaves it nothing but EOS once the JSON is whole) instead of running into max_tokens."""

    sky: Literal["sunny", "rainy"]


@pytest.fixture
def tiny_server(start_tiny_server: Callable[..., ServerThread]) -> ServerThread:
    """builtin:tiny with room for the tools' schemas rendered into the prompt, byte by byte."""
    return start_tiny_server(kv_cache_bytes=16 * MiB)


@pytest.fixture
async def async_client(tiny_server: ServerThread) -> AsyncIterator[openai.AsyncOpenAI]:
    set_tracing_disabled(True)  # traces would be exported to OpenAI's servers
    async with openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


async def test_an_agent_calls_its_forced_tool_and_finishes(async_client: openai.AsyncOpenAI,
                                                          tiny_server: ServerThread) -> None:
    calls: list[tuple[str, int]] = []

    @function_tool
    def forecast(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The weather forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        calls.append((city, days))
        return f"Sunny in {city} for {days} days."

    agent = Agent(name="forecaster", instructions="Answer with the forecast tool.", tools=[forecast],
                  model=OpenAIResponsesModel(model=tiny_server.model_name, openai_client=async_client),
                  output_type=Forecast, model_settings=ModelSettings(
                      tool_choice="forecast", max_tokens=120, temperature=1.0, extra_body={"seed": 1}))
    num_requests = len(tiny_server.engine.submitted)
    result = await Runner.run(agent, "Weather in Paris for three days?", max_turns=3)

    # The grammar makes the forced call's arguments valid, so the SDK could run the tool; then, its
    # tool_choice reset, the agent answered in the output type's schema with the tool's output in view.
    assert len(calls) == 1 and calls[0][0] in ("Paris", "Rome", "Oslo") and isinstance(calls[0][1], int)
    assert isinstance(result.final_output, Forecast)
    assert len(tiny_server.engine.submitted) - num_requests == 2
    first, second = tiny_server.engine.submitted[-2:]
    assert second.prompt_token_ids[:len(first.prompt_token_ids) - 16] == first.prompt_token_ids[:-16]
    assert f"Sunny in {calls[0][0]}" in tiny_server.context.tokenizer.decode(second.prompt_token_ids)
    assert all((response.response_id or "").startswith("resp_") for response in result.raw_responses)
