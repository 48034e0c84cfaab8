"""Speculative decoding through the server, as a client meets it: on by default, several tokens per step
streamed to the official openai client as the text a plain run gives, vLLM's
spec_decode counters per tenant in /metrics and the counts in /stats; "none" turns it off."""

from __future__ import annotations

import re

import httpx
import openai

from benchmarks.fake_executors import script_text
from tests.app.conftest import ServerThread, instant_context

MAX_TOKENS = 300  # the instant script repeats every ~80 bytes: prompt lookup proposes the rest of it


def stream_text(server: ServerThread) -> tuple[str, int]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": "Say it again."}], max_tokens=MAX_TOKENS,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage is not None
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), usage.completion_tokens


def spec_counter(metrics: str, name: str) -> float:
    found = re.search(rf'^fairlane:spec_decode_{name}_total{{[^}}]*tenant="default"[^}}]*}} (\S+)$', metrics,
                      re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def test_a_speculating_server_streams_plain_decodings_text_and_counts_it() -> None:
    server = ServerThread(instant_context()).start()
    # The instant executor costs nothing: its steps' times are the scheduler's own noise, which no cost model
    # should be fitted to. Unfitted, the scheduler verifies every proposal it has.
    cost_model = server.engine.scheduler.shaper.cost_model
    cost_model.forget()
    cost_model.min_samples = 1 << 30
    try:
        text, completion_tokens = stream_text(server)
        assert text == script_text(MAX_TOKENS)
        assert completion_tokens == MAX_TOKENS
        speculation = server.stats()["speculation"]
        assert speculation["num_accepted_tokens"] > MAX_TOKENS // 2  # most tokens came from accepted proposals
        assert server.engine.scheduler.counters.num_steps < MAX_TOKENS // 2
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert spec_counter(metrics, "num_accepted_tokens") == speculation["num_accepted_tokens"]
        assert spec_counter(metrics, "num_draft_tokens") == speculation["num_draft_tokens"]
        assert spec_counter(metrics, "num_drafts") == speculation["num_drafts"]
        assert 'fairlane:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics
    finally:
        server.stop()


def test_none_turns_speculation_off() -> None:
    server = ServerThread(instant_context(speculative_config="none")).start()
    try:
        text, _ = stream_text(server)
        assert text == script_text(MAX_TOKENS)
        assert server.stats()["speculation"] is None
        assert "spec_decode" not in httpx.get(f"{server.base_url}/metrics", timeout=10).text
    finally:
        server.stop()
