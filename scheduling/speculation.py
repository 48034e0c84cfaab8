"""Speculative decoding, as the scheduler owns it: who proposes tokens, how many each decode verifies, and
what was accepted.

A running request's decode may carry proposed tokens: the runner feeds them as extra query rows of the
same sequence and verifies them in the step's one forward (gpu/verification.py); the accepted ones and one
more come back. The proposers:

- `ngram` (prompt lookup, as vLLM's and llama.cpp's): the longest of the request's last n tokens
  (prompt_lookup_max down to prompt_lookup_min) that occurred before in its prompt or output proposes the
  tokens that followed its latest occurrence (and, past the end of the context, what the proposal itself
  says follows: an occurrence p tokens back proposes a loop of period p). Code edits, rewrites, quoting
  answers and agents re-emitting tool arguments copy long spans of their context.
- `suffix`: the same over the request's own tokens first, then over its tenant's recent outputs (agents
  repeat themselves across requests). A tenant's outputs never propose for another tenant.
- `draft_model`: a smaller model with the same tokenizer, run by the runner after each step (gpu/draft.py),
  proposes for the next one; the scheduler keeps what it proposed for the request's current length.

How many tokens a decode verifies is decided per step from the step cost model (scheduling/step_cost.py)
and each request's measured acceptance: with acceptance rate a, k proposals are expected to add
a + a^2 + ... + a^k tokens, and each adds its predicted cost to the step. A proposal is added only while
the step's expected tokens per second grow (so none once the step is compute-bound), within the token
budget and any shaped time, interactive requests first (the plan's order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from contract.plan import SamplingParams
from scheduling.step_cost import CostCoefficients, sequence_attention

SpeculationMethod = Literal["ngram", "suffix", "draft_model"]
PRIOR_ACCEPTANCE = 0.5  # a request's acceptance rate before any of its proposals were verified
ACCEPTANCE_MEMORY = 0.3  # the weight of the latest step in a request's acceptance rate (a moving average)
UNPROFITABLE_RATE = 0.05  # below this acceptance rate a request stops proposing for a while
RETRY_AFTER_STEPS = 16  # ...and tries again after this many of its decodes


@dataclass(slots=True, frozen=True)
class SpeculationConfig:
    method: SpeculationMethod = "ngram"
    num_speculative_tokens: int = 4  # the most a decode verifies
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix: how many recent output tokens of each tenant propose for its other requests
    tenant_history_tokens: int = 16_384


class NgramIndex:
    """Where each n-gram of a token list last ended, for n in [min_n, max_n], kept up to date as the list
    grows: a lookup is a dict access per n, not a scan of the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions <= this are in _ends

    def catch_up(self, tokens: Sequence[int], upto: int) -> None:
        """Index every n-gram ending at or before `upto`."""
        for end in range(max(self._indexed + 1, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def continuation(self, tokens: Sequence[int], suffix_end: int) -> tuple[int, int]:
        """(where the continuation starts, n) for the longest n-gram ending at suffix_end seen ending before
        it; (-1, 0) when none."""
        for n in range(min(self.max_n, suffix_end), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[suffix_end - n:suffix_end]))
            if end is not None and end < suffix_end:
                return end, n
        return -1, 0


class NgramProposer:
    """Prompt lookup over one request's tokens."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, and
        the suffix's length (0: nothing found)."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        length = len(tokens)
        index.catch_up(tokens, length - 1)  # every earlier n-gram; the suffix itself is looked up
        start, n = index.continuation(tokens, length)
        if start < 0:
            return [], 0
        # Copying on from the match: once the copy reaches the end of the context, it copies its own proposals,
        # so a match that ended p tokens ago proposes a loop of period p (a model repeating a phrase).
        period = length - start
        return [tokens[start + i % period] for i in range(k)], n

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


class TenantHistory:
    """A tenant's recent outputs, indexed by n-gram: the continuation of the latest occurrence in any of
    them. Old outputs leave when the history passes its size; the index is rebuilt when it holds twice
    the entries the kept outputs need."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self._outputs: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._num_tokens = 0
        self._next_id = 0
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, end)

    def add(self, output: Sequence[int]) -> None:
        if len(output) <= self.min_n:
            return
        output = tuple(output[-self.max_tokens:])
        key = self._next_id
        self._next_id += 1
        self._outputs[key] = output
        self._num_tokens += len(output)
        while self._num_tokens > self.max_tokens:
            _, dropped = self._outputs.popitem(last=False)
            self._num_tokens -= len(dropped)
        self._index(key, output)
        if len(self._ends) > 2 * (self.max_n - self.min_n + 1) * max(self._num_tokens, 1):
            self._ends.clear()
            for kept, tokens in self._outputs.items():
                self._index(kept, tokens)

    def _index(self, key: int, output: tuple[int, ...]) -> None:
        for end in range(self.min_n, len(output)):  # an n-gram ending at the last token has no continuation
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[output[end - n:end]] = (key, end)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            found = self._ends.get(tuple(tokens[len(tokens) - n:]))
            if found is not None and found[0] in self._outputs:
                output = self._outputs[found[0]]
                return list(output[found[1]:found[1] + k]), n
        return [], 0


@dataclass(slots=True)
class SpeculationCounters:
    """vLLM's spec_decode counters, in all and per tenant."""

    num_drafts: int = 0  # decodes that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    by_tenant: dict[str, list[int]] = field(default_factory=dict)  # tenant -> [drafts, draft tokens, accepted]


@dataclass(slots=True)
class _Acceptance:
    rate: float = PRIOR_ACCEPTANCE
    paused_for: int = 0  # decodes left before an unprofitable request proposes again


class Speculator:
    """Proposals, acceptance rates and counters; the scheduler asks it for each decode of a step."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self.ngrams = NgramProposer(config)
        self.histories: dict[str, TenantHistory] = {}
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._acceptance: dict[str, _Acceptance] = {}
        self._model_proposals: dict[str, tuple[int, list[int]]] = {}  # draft_model: (for how many tokens, tokens)

    def acceptance_rate(self, request_id: str) -> float:
        state = self._acceptance.get(request_id)
        return PRIOR_ACCEPTANCE if state is None else state.rate

    @property
    def drafts_with_model(self) -> bool:
        return self.config.method == "draft_model"

    def wants_proposals(self, request_id: str) -> bool:
        """Whether the draft model should propose for the request (not while its proposals pause)."""
        state = self._acceptance.get(request_id)
        return state is None or not state.paused_for

    def keep_model_proposals(self, request_id: str, num_tokens: int, proposals: Sequence[int]) -> None:
        """The draft model's proposals to follow a request of num_tokens tokens."""
        self._model_proposals[request_id] = (num_tokens, list(proposals))

    def propose(self, request_id: str, tenant_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k proposed tokens to follow `tokens` (a running request's prompt and output so far)."""
        state = self._acceptance.get(request_id)
        if state is not None and state.paused_for:
            state.paused_for -= 1
            return []
        if self.drafts_with_model:
            num_tokens, proposals = self._model_proposals.pop(request_id, (-1, []))
            return proposals[:k] if num_tokens == len(tokens) else []
        drafts, n = self.ngrams.propose(request_id, tokens, k)
        if self.config.method == "suffix":
            history = self.histories.get(tenant_id)
            if history is not None and len(drafts) < k:
                shared, shared_n = history.propose(tokens, k)
                if shared_n > n or (shared_n == n and len(shared) > len(drafts)):
                    drafts = shared
        return drafts

    def observe(self, request_id: str, tenant_id: str, num_proposed: int, num_accepted: int) -> None:
        """A decode verified num_proposed tokens and accepted the first num_accepted."""
        state = self._acceptance.setdefault(request_id, _Acceptance())
        state.rate += ACCEPTANCE_MEMORY * (num_accepted / num_proposed - state.rate)
        if state.rate < UNPROFITABLE_RATE:
            state.paused_for, state.rate = RETRY_AFTER_STEPS, PRIOR_ACCEPTANCE / 2
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_proposed
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1
        per_tenant = counters.by_tenant.setdefault(tenant_id, [0, 0, 0])
        per_tenant[0] += 1
        per_tenant[1] += num_proposed
        per_tenant[2] += num_accepted

    def finished(self, request_id: str, tenant_id: str, output: Sequence[int]) -> None:
        self.ngrams.forget(request_id)
        self._model_proposals.pop(request_id, None)
        self._acceptance.pop(request_id, None)
        if self.config.method == "suffix":
            history = self.histories.get(tenant_id)
            if history is None:
                history = self.histories[tenant_id] = TenantHistory(
                    self.config.prompt_lookup_min, self.config.prompt_lookup_max, self.config.tenant_history_tokens)
            history.add(output)


def expected_accepted(rate: float, k: int) -> float:
    """Tokens a decode verifying k proposals is expected to accept, each accepted with probability `rate`
    once those before it were: rate + rate^2 + ... + rate^k."""
    return sum(rate ** i for i in range(1, k + 1))



def may_speculate(sampling: SamplingParams) -> bool:
    """Whether a request's decodes may carry proposals. Not when sampling with a seed: a seeded request
    draws once per token from its own generator, and its tokens must not depend on how many proposals the
    load let it verify. (Under a grammar they may: the runner cuts a proposal its grammar rejects.)"""
    return sampling.is_greedy or sampling.seed is None


def best_draft_count(num_drafts: int, rate: float, start_position: int, step_tokens: int, expected_tokens: float,
                     predicted_s: float, coefficients: CostCoefficients, residual: Callable[[int], float]
                     ) -> tuple[int, float]:
    """How many of a decode's num_drafts proposals make the step's expected tokens per second highest (0:
    none pays), and the time they add. The step so far computes step_tokens tokens, is expected to yield
    expected_tokens and predicted to take predicted_s; the residual is the cost model's per token count
    (a kernel change past some rows is where verification stops paying on a CPU)."""
    if predicted_s <= 0.0:
        return num_drafts, 0.0
    best_k, best_added_s, best_rate = 0, 0.0, expected_tokens / predicted_s
    per_draft_s = coefficients.per_token_s + coefficients.per_sequence_s  # as one more decode
    base_attention, base_residual = sequence_attention(1, start_position), residual(step_tokens)
    accepted, odds = 0.0, 1.0
    for k in range(1, num_drafts + 1):
        odds *= rate
        accepted += odds  # expected_accepted(rate, k), built up
        added_s = max(0.0, per_draft_s * k
                      + coefficients.per_attention_s * (sequence_attention(1 + k, start_position) - base_attention)
                      + residual(step_tokens + k) - base_residual)
        tokens_per_s = (expected_tokens + accepted) / (predicted_s + added_s)
        if tokens_per_s > best_rate:
            best_k, best_added_s, best_rate = k, added_s, tokens_per_s
    return best_k, best_added_s
