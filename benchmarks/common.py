"""Pieces shared by the in-process benchmarks: a seeded workload, per-system results, peak memory.

Torch-free: the systems under test import their own stacks; this module only describes and reports.
"""

from __future__ import annotations

import random
import resource
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

KiB = 1024
MiB = 1024 * 1024


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """How a workload is drawn: lengths uniform in inclusive ranges, tokens uniform in [0, vocab)."""

    num_requests: int
    seed: int
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (16, 256)
    vocab: int = 256  # byte tokens: valid ids for any model, never a builtin special token


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    num_output_tokens: int  # generated exactly: end-of-sequence tokens do not stop a benchmark request


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The same requests for every system and every run with the same spec."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_len)
        output_len = rng.randint(*spec.output_len)
        prompt = [rng.randrange(spec.vocab) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, output_len))
    return requests


@dataclass(slots=True)
class SystemResult:
    """One system's run of the whole workload."""

    name: str
    wall_seconds: float  # from submitting the first request to receiving the last token
    num_output_tokens: int  # tokens counted: each request's own output length, never more
    peak_rss_bytes: int  # peak resident memory of the process that ran this system
    output_token_ids: list[list[int]] = field(default_factory=list)  # per request, in workload order
    extra: dict[str, Any] = field(default_factory=dict)  # system-specific counters

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        summary = {k: v for k, v in asdict(self).items() if k not in ("name", "output_token_ids", "extra")}
        return {**summary, "tokens_per_s": self.tokens_per_s, "peak_rss_mib": self.peak_rss_bytes / MiB,
                **self.extra}


def peak_rss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    """Peak resident set size so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(who).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * KiB


def count_requested_tokens(outputs: Sequence[Sequence[int]], workload: Sequence[BenchRequest]) -> int:
    """Tokens that count: a request's tokens up to its own output length (extra ones are padding work)."""
    return sum(min(len(out), req.num_output_tokens) for out, req in zip(outputs, workload, strict=True))


def exact_match_fraction(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
                         workload: Sequence[BenchRequest]) -> float:
    """Share of requests whose requested tokens are identical in both systems."""
    same = sum(list(a[:r.num_output_tokens]) == list(b[:r.num_output_tokens])
               for a, b, r in zip(ours, theirs, workload, strict=True))
    return same / len(workload) if workload else 0.0


def common_prefix_fraction(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
                           workload: Sequence[BenchRequest]) -> float:
    """Mean share of each request's tokens generated before the two systems first differ."""
    def shared(a: Sequence[int], b: Sequence[int], length: int) -> int:
        return next((i for i in range(length) if i >= len(a) or i >= len(b) or a[i] != b[i]), length)

    shares = [shared(a, b, r.num_output_tokens) / r.num_output_tokens
              for a, b, r in zip(ours, theirs, workload, strict=True) if r.num_output_tokens]
    return sum(shares) / len(shares) if shares else 0.0

