"""How far the queue order may pass a request over, measured against first come, first served.

Shortest-work-first orders (HRRN, SRPT) cut the mean time to first token by computing short prompts
before long ones; past capacity they can pass a long prompt over for as long as short ones keep
coming. A bound in seconds (`queue_aging_s`) is either too short to let the order work when every
request waits long, or too long to protect the long prompts when waits are short. This bound scales
with the load instead. Under FCFS a request's first token comes once its line (its tenant's requests
of its class) has computed the prompt tokens ahead of it on arrival, then its own: W tokens. A
request is *overdue* once it could no longer get its first token within `stretch` times W of the
line's work, that is once the line has computed `stretch * W - own` tokens since it arrived; overdue
requests go first, oldest first. A long prompt's first token then comes within about `stretch` times
FCFS's, whatever the load, and a short one is passed over only as far.

Counted per tenant and class (one waiting line), in prompt tokens computed for the first time: a
recompute after a preemption does not move the count, and a cached prefix is never outstanding.
"""

from __future__ import annotations

from collections import Counter

from scheduling.request import PriorityClass, Request, RequestId

LineKey = tuple[PriorityClass, str]


class FcfsBound:
    def __init__(self, stretch: float) -> None:
        self.stretch = stretch  # 0: off (nothing is ever overdue by this bound)
        self._computed: Counter[LineKey] = Counter()  # prompt tokens computed, per line, ever
        self._outstanding: Counter[LineKey] = Counter()  # prompt tokens not yet computed of unfinished requests
        self._remaining: dict[RequestId, int] = {}  # per unfinished request, in its line's `_outstanding`
        self._due_at: dict[RequestId, float] = {}  # the line's `_computed` at which the request is overdue

    def arrived(self, request: Request) -> None:
        key = (request.priority, request.tenant_id)
        # FCFS would have its prompt computed once the line computed what was ahead and then its own:
        # it may take `stretch` times that, so it must start by then, less its own.
        ahead, own = self._outstanding[key], request.num_prompt_tokens
        self._due_at[request.request_id] = self._computed[key] + self.stretch * (ahead + own) - own
        self._remaining[request.request_id] = request.num_prompt_tokens
        self._outstanding[key] += request.num_prompt_tokens

    def found_cached(self, request: Request, num_cached: int) -> None:
        """Its prefix came from the cache: never computed, no longer outstanding."""
        self._take(request, num_cached)

    def computed(self, request: Request, num_tokens: int) -> None:
        """Prompt tokens computed for the first time."""
        taken = self._take(request, num_tokens)
        self._computed[(request.priority, request.tenant_id)] += taken
        if request.request_id in self._due_at:  # its own work counts for the others, not against itself
            self._due_at[request.request_id] += taken

    def ended(self, request: Request) -> None:
        self._take(request, self._remaining.get(request.request_id, 0))
        self._remaining.pop(request.request_id, None)
        self._due_at.pop(request.request_id, None)

    def __len__(self) -> int:
        """The requests it tracks: the unfinished ones."""
        return len(self._due_at)

    def is_overdue(self, request: Request) -> bool:
        due_at = self._due_at.get(request.request_id)
        return (self.stretch > 0 and due_at is not None
                and self._computed[(request.priority, request.tenant_id)] >= due_at)

    def _take(self, request: Request, num_tokens: int) -> int:
        remaining = self._remaining.get(request.request_id, 0)
        taken = min(remaining, max(0, num_tokens))
        if taken:
            self._remaining[request.request_id] = remaining - taken
            self._outstanding[(request.priority, request.tenant_id)] -= taken
        return taken
