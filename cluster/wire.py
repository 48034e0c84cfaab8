"""What crosses process boundaries between the ingress, the replicas and the board: plain data that
Ray pickles. Ray-free, so the HTTP side and the tests can build it without a cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contract.plan import CacheGeometry
from gpu.tokenizer import Tokenizer
from scheduling.prefix_cache import prompt_block_hashes
from scheduling.request import Request, TokenEvent
from scheduling.snapshot import SchedulerSnapshot
from tenancy.tenants import TenantRegistry

# Per class, per tenant: unweighted VTC service (the units of VirtualTokenCounter.service).
ServiceByTenant = dict[str, dict[str, float]]


@dataclass(slots=True, frozen=True)
class ReplicaCall:
    """One request as the ingress sends it to the replica the router picks."""

    request: Request  # never stepped here: the replica's scheduler owns its copy
    block_hashes: tuple[bytes, ...]  # the prompt's salted hash chain of full blocks, as the replica computes it
    # Disaggregated serving (cluster/handoff.py): where a prefill replica published the prompt's blocks,
    # for the decode replica to receive before it admits the request. None: nothing to receive.
    handoff_location: str | None = None

    @property
    def prompt(self) -> str:
        """The prompt for Ray's PrefixCacheAffinityRouter, which matches character prefixes: one character
        per token, so its prefixes are token prefixes (it knows nothing of the salt)."""
        return "".join(map(chr, self.request.prompt_token_ids))


@dataclass(slots=True, frozen=True)
class HandoffNote:
    """A replica's word on a KV hand-off, after a request's events: from a prefill replica, whether (and
    where) the prompt's blocks were published; from a decode replica, first, how many it received."""

    location: str | None  # the publisher's location; None when nothing could be published
    num_blocks: int  # blocks published, or received
    seconds: float  # waiting for the writes, or reading them
    num_missed: int = 0  # received: blocks it held room for and could not read (recomputed)


def replica_call(request: Request, block_size: int) -> ReplicaCall:
    return ReplicaCall(request, prompt_block_hashes(request.prompt_token_ids, block_size, request.cache_salt))


@dataclass(slots=True, frozen=True)
class ReplicaDescription:
    """What the ingress needs from a replica before it serves: it loads no model (nor torch) of its own,
    and checks admission with the replicas' own geometry and tenants."""

    replica_id: str
    tokenizer: Tokenizer
    geometry: CacheGeometry
    tenants: TenantRegistry


@dataclass(slots=True, frozen=True)
class ReplicaReport:
    """A replica's periodic report to the board: the service it gave since its last report, its
    health, its /stats and its scheduler's snapshot. The board keeps the latest per replica for the
    ingress's /health, /stats and /metrics."""

    replica_id: str
    service: ServiceByTenant  # since the previous report
    is_healthy: bool
    reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)
    sent_at: float = 0.0  # time.time() on the replica: the board and the ingress judge staleness by it
    snapshot: SchedulerSnapshot | None = None  # its scheduler's, for the ingress's /metrics


def ended_event(request: Request, last: TokenEvent | None, finish_reason: str, error: str | None = None
                ) -> TokenEvent:
    """The final event of a request ended at the ingress (aborted, stopped, or its replica lost),
    with the counts of the last event its replica sent."""
    num_output = last.num_output_tokens if last is not None else 0
    num_cached = last.num_cached_tokens if last is not None else 0
    return TokenEvent(request.request_id, (), finish_reason, request.num_prompt_tokens, num_output, num_cached,
                      error)
