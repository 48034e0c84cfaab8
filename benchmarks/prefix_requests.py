"""One request of the prefix-cache benchmarks (`bench prefix`, with and without `--tiers`) and what it gives."""

from __future__ import annotations

import time
from dataclasses import dataclass

from scheduling.engine import Engine
from scheduling.request import Request, RequestId


@dataclass(slots=True, frozen=True)
class Outcome:
    ttft: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


async def one_request(engine: Engine, request_id: str, prompt: list[int], max_tokens: int,
                      cache_salt: str = "") -> Outcome:
    """Submit a greedy request that runs to max_tokens (no stop token); its TTFT and token counts."""
    started = time.perf_counter()
    ttft = 0.0
    last = None
    request = Request(RequestId(request_id), prompt, max_tokens, stop_token_ids=frozenset(), cache_salt=cache_salt)
    async for event in engine.submit(request):
        if not ttft:
            ttft = time.perf_counter() - started
        last = event
    assert last is not None and last.finish_reason == "length", last
    return Outcome(ttft, last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens)
