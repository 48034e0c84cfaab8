"""A request, its lifecycle, and the events it emits."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

from contract.plan import BASE_MODEL_SLOT, LoraRef, SamplingParams, TokenLogprobs
from tenancy.tenants import DEFAULT_TENANT, TenantId

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    """Only the scheduler changes a request's status."""

    # Members are singletons compared by identity: hash them the same way, in C. Enum's own __hash__
    # is a Python function, and the scheduler looks statuses and classes up for every running request.
    __hash__ = object.__hash__

    WAITING = "waiting"  # queued; also a request preempted by recompute
    RUNNING = "running"  # holds device blocks and is scheduled each step
    SWAPPED = "swapped"  # its blocks live in the CPU pool until it is swapped back in
    FINISHED_STOPPED = "finished_stopped"  # met a stop token (or a stop string, told by the API layer)
    FINISHED_LENGTH = "finished_length"  # reached max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"  # the client left or asked to stop
    FINISHED_ERROR = "finished_error"  # the engine failed while running it

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


class PriorityClass(enum.Enum):
    """Interactive is served first; batch uses what it leaves and is preempted for it."""

    __hash__ = object.__hash__  # see RequestStatus

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """Lower runs first and is preempted last."""
        return 0 if self is PriorityClass.INTERACTIVE else 1


# The OpenAI finish_reason of each finished status, in one place.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def finish_reason(status: RequestStatus) -> str | None:
    return _FINISH_REASONS.get(status)


@dataclass(slots=True, eq=False)
class Request:
    """One generation. `num_computed_tokens` catches up to `num_tokens`: prefill chunks, decodes and
    the resume of a recomputed request are all the same path.

    Each field has one writer: the API layer sets the request up, and the engine adds its prompt's
    block hashes when it is submitted; after `add_request` the scheduler alone changes it, except
    `first_token_time`, which the engine stamps when it hands the first token to the stream. Its KV
    blocks are not here: the block manager keeps them by request id."""

    request_id: RequestId
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()  # empty to ignore EOS (benchmarks)
    tenant_id: TenantId = DEFAULT_TENANT
    priority: PriorityClass = PriorityClass.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt then output; filled in __post_init__
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_charged_prompt_tokens: int = 0  # prompt positions already charged to the tenant's counter
    cache_salt: str = ""  # isolates prefix-cache entries: the tenant or its cache group, plus any request salt
    # A cache breakpoint (scheduling/cache_pins.py): the prompt's first cache_pin_tokens are kept for
    # cache_pin_ttl_s seconds after the request's last use of them. 0: none.
    cache_pin_tokens: int = 0
    cache_pin_ttl_s: float = 0.0
    # The hash chain of the prompt's full blocks (scheduling/prefix_cache.py), made by Engine.submit on the
    # caller's side of the queue, so that no step spends its time hashing the prompts it admits; empty, the
    # block manager hashes them when it first needs them.
    prompt_block_hashes: tuple[bytes, ...] = ()
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for prompt positions 1.., when asked
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # When its first token is due (the clock of `arrival_time`), if the client set a TTFT deadline: its
    # tenant's line orders such requests by slack (scheduling/queue_order.py).
    ttft_deadline: float | None = None
    predicted_output_tokens: int = 0  # set by the scheduler when the request arrives (output_lengths.py)
    itl_target_s: float | None = None  # its tenant's ITL target: steps it runs in are shaped to it
    # Tokens its stream's reader is woken for at once after the first (scheduling/engine.py, RequestStream): 1
    # wakes it at every step that gives the request a token.
    stream_interval: int = 1
    adapter: LoraRef | None = None  # the LoRA adapter the request runs on; None for the base model
    # On a prefill replica (cluster/handoff.py): once its prompt is computed, the runner publishes the
    # prompt's full blocks for a decode replica to continue from.
    publish_kv: bool = False
    # At a disaggregated cluster's ingress: (seconds the prefill replica waited for its blocks' writes,
    # seconds the decode replica spent receiving them), for the request's trace.
    kv_handoff_s: tuple[float, float] | None = None
    lora_slot: int = BASE_MODEL_SLOT  # the device slot its adapter sits in while it runs (the scheduler's)
    # len(prompt_token_ids), kept as a plain attribute: the scheduler reads it for every running request
    # at every step, and a property costs three times as much.
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


class TokenEvent(NamedTuple):
    """What a request's stream receives after a step: new tokens, and a finish reason at the end.
    A tuple, so it cannot change once made, and the scheduler, which makes one per running request per
    step, can build it with `tuple.__new__` at about half a dataclass's cost."""

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    finish_reason: str | None  # None while the request goes on
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason "error"
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with the first token: one per prompt token after the first

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


def merged(first: TokenEvent, later: Sequence[TokenEvent]) -> TokenEvent:
    """Consecutive events of one request as one: all their tokens, the counts and end of the last."""
    if not later:
        return first
    tokens = first.new_token_ids + tuple(token for event in later for token in event.new_token_ids)
    logprobs = first.logprobs + tuple(entry for event in later for entry in event.logprobs)
    prompt_logprobs = first.prompt_logprobs + tuple(entry for event in later for entry in event.prompt_logprobs)
    return later[-1]._replace(new_token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
