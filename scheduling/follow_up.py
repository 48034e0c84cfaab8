"""Waiting a moment for a closed-loop client's next request before planning the next step.

A chat client or an agent sends its next request as soon as the last token of the one before arrives: on
loopback 2-3 ms after the end of the step that ended it. By then the next step has started, and the
request waits for all of it (four streams' decode step, 11-13 ms on a Zen 5 EPYC; beside a batch flood a
step of up to the arrival budget). Four closed-loop streams' prompts so waited 12.7 ms at the median for
their first step, and a third of them, sent while another stream's prompt was computed, 40-60 ms
(docs/loadtest.md). After a step that ended an interactive request, the engine waits up to `wait_s` for a
command before planning the next one, so such a request starts in it.

The wait holds every running request, so it is bounded twice. It is taken while it pays: while at least
`min_hit_rate` of the recent waits (an average over about the last ten) caught an interactive request; one
wait in `probe_every` is taken regardless, to notice clients that start following up again. And all the
waits together take at most `max_share` of the engine's busy time (a budget earned step by step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HIT_RATE_WEIGHT = 0.1  # of the newest wait in the hit rate's average: about the last ten count
BUDGET_WAITS = 4  # the most waiting time saved up, in waits


@dataclass(slots=True)
class FollowUpCounters:
    waits: int = 0
    caught: int = 0  # waits that ended with an interactive request arrived
    waited_s: float = 0.0


@dataclass(slots=True)
class FollowUpWait:
    wait_s: float = 0.0  # 0: never wait
    min_hit_rate: float = 0.3
    max_share: float = 0.05  # of the engine's busy time
    probe_every: int = 8
    hit_rate: float = 1.0  # recent waits that caught a request; a fresh engine expects them to
    counters: FollowUpCounters = field(default_factory=FollowUpCounters)
    _budget_s: float = field(init=False)  # waiting time earned and not spent, at most BUDGET_WAITS waits
    _passed: int = field(init=False, default=0)  # waits passed over while the hit rate is low, since the last probe

    def __post_init__(self) -> None:
        self._budget_s = BUDGET_WAITS * self.wait_s  # a fresh engine may wait at once

    def earn(self, step_s: float) -> None:
        """A step ran for step_s: the waits may take their share of it."""
        self._budget_s = min(self._budget_s + self.max_share * step_s, BUDGET_WAITS * self.wait_s)

    def should_wait(self) -> bool:
        if self.wait_s <= 0 or self._budget_s < self.wait_s:
            return False
        if self.hit_rate >= self.min_hit_rate:
            return True
        self._passed += 1
        if self._passed < self.probe_every:
            return False
        self._passed = 0
        return True

    def record(self, waited_s: float, caught: bool) -> None:
        """A wait ended after waited_s, with an interactive request arrived or not."""
        self._budget_s -= waited_s
        self.hit_rate += HIT_RATE_WEIGHT * (float(caught) - self.hit_rate)
        self.counters.waits += 1
        self.counters.caught += caught
        self.counters.waited_s += waited_s
