"""Disaggregated serving: a request's prompt runs on a prefill replica, its decode on a decode replica.

    ingress --prefill(call)--> prefill replica: computes the prompt, samples the first token (max_tokens 1),
       |                       publishes the prompt's full blocks (gpu/kv_handoff.py), answers the first
       |                       token's events, then a HandoffNote (where the blocks are, or None)
       |   the first token goes to the client at once
       +--generate(call + the first token + the location)--> decode replica: receives the blocks into
                               held host blocks, then admits the request, prompt and first token, whose
                               prompt blocks are now a prefix-cache hit, and decodes the rest

Nothing here is lost: a prefill replica that fails before its first token leaves the whole request to a
decode replica; one that fails after it, or a block the decode replica cannot read, only means the decode
replica computes that part again; a decode replica that fails mid-decode hands the request, with every
token it got, to another decode replica. Each request still ends once, with its whole output.

Ray-free and torch-free: the ingress (which loads neither model nor torch) uses the request helpers, a
decode replica `receive_blocks` with the runner's reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from cluster.wire import HandoffNote, ReplicaCall
from scheduling.engine import Engine
from scheduling.request import Request, TokenEvent

# How long a decode replica waits for its engine to hold host blocks (one step boundary, normally).
HOLD_TIMEOUT_S = 30.0

# (location, [(block hash, host block)]) -> (hashes filled, hashes not filled); run in a worker thread.
ReadBlocks = Callable[[str, list[tuple[bytes, int]]], tuple[list[bytes], list[bytes]]]


def may_hand_off(call: ReplicaCall, min_prompt_tokens: int = 0) -> bool:
    """Whether the request goes to a prefill replica first: a prompt of at least min_prompt_tokens, with a
    full block to hand over, that can continue on another replica from its prompt's blocks and first token
    alone. Not when the runner keeps state of its own beyond those (a grammar's matcher, a seeded
    generator's position), nor for prompt logprobs (every prompt position's logits, never cached), nor a
    request of one token. Those run whole on a decode replica."""
    request, sampling = call.request, call.request.sampling
    return (request.max_tokens > 1 and sampling.structured is None and sampling.seed is None
            and sampling.prompt_logprobs is None and bool(call.block_hashes)
            and request.num_prompt_tokens >= min_prompt_tokens)


def prefill_request(request: Request) -> Request:
    """The prefill replica's part: the prompt and its first token, the prompt's blocks published."""
    return replace(request, max_tokens=1, publish_kv=True, token_ids=list(request.prompt_token_ids))


def continuation(request: Request, output_token_ids: Sequence[int]) -> Request:
    """The request as a decode replica takes it over, with the output tokens it already has."""
    return replace(request, token_ids=[*request.prompt_token_ids, *output_token_ids])


def ends_at_prefill(request: Request, event: TokenEvent) -> bool:
    """Whether the prefill replica's final event ends the request itself: a stop token, an error, or the
    request's own length. Its prefill part always ends at one token ("length"): that is not the end."""
    return event.finish_reason != "length" or request.max_tokens <= event.num_output_tokens


def going_on(event: TokenEvent) -> TokenEvent:
    """The prefill replica's final event as the request's first tokens: not final."""
    return event._replace(finish_reason=None)


def with_cached_tokens(event: TokenEvent, num_cached_tokens: int) -> TokenEvent:
    """A decode replica's event with the prompt's cached tokens as the prefill replica counted them: its
    own count holds the handed-off blocks, which the tenant's usage must not show as cache hits."""
    return event if event.num_cached_tokens == num_cached_tokens else event._replace(
        num_cached_tokens=num_cached_tokens)


async def receive_blocks(engine: Engine, chain: Sequence[bytes], location: str, read: ReadBlocks,
                         hold_timeout_s: float = HOLD_TIMEOUT_S) -> HandoffNote:
    """On a decode replica, before it admits the request: the published blocks of the prompt's chain it
    does not hold yet, read into host blocks held for them, then released for the admission to find.
    A block that cannot be read (and every one after it) is only recomputed."""
    started = time.perf_counter()
    held = await asyncio.wait_for(engine.hold_for_import(chain), hold_timeout_s)
    if not held:
        return HandoffNote(location, 0, time.perf_counter() - started)
    try:
        filled, failed = await asyncio.to_thread(read, location, held)
    except BaseException:
        engine.release_imports([], [block_hash for block_hash, _ in held])
        raise
    engine.release_imports(filled, failed)
    return HandoffNote(location, len(filled), time.perf_counter() - started, len(failed))
