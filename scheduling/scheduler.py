"""The scheduler: at every step, who runs, how many tokens each, and with which blocks.

Counters, not phases: each request's `num_computed_tokens` catches up to `num_tokens`. Running
decodes go first, then running prefill chunks, then newly admitted requests, all within a token
budget and a sequence cap. Only this class changes a request's status.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gpu.plan import CacheGeometry, ScheduledSequence, StepPlan, StepResult
from scheduling.block_manager import KVBlockManager
from scheduling.queue import create_request_queue
from scheduling.request import Request, RequestId, RequestStatus, TokenEvent, finish_reason


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step, decodes and prefill chunks together
    queue_policy: str = "fcfs"


@dataclass(slots=True)
class SchedulerCounters:
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions_recompute: int = 0


class AdmissionError(ValueError):
    """A request that could never run on this engine (too long for the model or the KV memory)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, geometry: CacheGeometry) -> None:
        self.config = config
        self.geometry = geometry
        self.blocks = KVBlockManager(geometry.num_device_blocks, geometry.num_cpu_blocks, geometry.block_size)
        self.waiting = create_request_queue(config.queue_policy)
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.counters = SchedulerCounters()
        self._finished_ids: list[str] = []  # told to the runner with the next plan

    # ---- commands -------------------------------------------------------------------------

    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError for a request that could never finish here."""
        total = num_prompt_tokens + max_tokens
        if total > self.geometry.max_model_len:
            raise AdmissionError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                f"more than the model's context of {self.geometry.max_model_len} tokens")
        blocks = -(-total // self.geometry.block_size)
        if blocks > self.geometry.num_device_blocks:
            raise AdmissionError(
                f"prompt plus max_tokens ({total} tokens) needs more KV memory than the server has "
                f"({self.geometry.num_device_blocks * self.geometry.block_size} tokens)")

    def add_request(self, request: Request) -> None:
        self.check_admissible(request.num_prompt_tokens, request.max_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: RequestId, status: RequestStatus) -> TokenEvent | None:
        """End a request from outside (abort, or a stop string seen by the API layer)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self._finish(request, status)
        return self._event(request, ())

    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting))

    # ---- schedule -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = [self.config.max_num_batched_tokens]
        preempted = self._schedule_running(plan, budget)
        if not preempted:  # admitting right after preempting would only thrash
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: list[int]) -> bool:
        """Decodes first, then unfinished prefills. Returns whether anything was preempted."""
        pending = deque(sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1))
        preempted = False
        while pending:
            request = pending.popleft()
            num_new = min(request.num_uncomputed_tokens, budget[0])
            if num_new == 0:
                continue
            while self.blocks.allocate_slots(request, num_new) is None:
                victim = max([request, *pending], key=lambda r: r.arrival_time)  # the newest gives way
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                pending.remove(victim)
            else:
                plan.sequences.append(self._scheduled(request, num_new))
                budget[0] -= num_new
        return preempted

    def _admit_waiting(self, plan: StepPlan, budget: list[int]) -> None:
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs and budget[0] > 0:
            request = self.waiting.peek()
            num_new = min(request.num_uncomputed_tokens, budget[0])
            if self.blocks.allocate_slots(request, num_new) is None:
                return
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.sequences.append(self._scheduled(request, num_new))
            budget[0] -= num_new

    def _preempt(self, request: Request) -> None:
        """Recompute: drop the KV, requeue at the head; on resume it prefills prompt + output so far."""
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self.waiting.prepend(request)
        self.counters.num_preemptions_recompute += 1

    @staticmethod
    def _scheduled(request: Request, num_new: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.token_ids[start:start + num_new],
            start_position=start,
            block_table=list(request.block_ids),
            needs_sample=start + num_new == request.num_tokens,
            sampling=request.sampling,
        )

    # ---- update ---------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Advance the counters by what the step computed; a token event per sampled request."""
        events: list[TokenEvent] = []
        for seq in plan.sequences:
            request = self.requests.get(RequestId(seq.request_id))
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(seq.token_ids)
            if seq.needs_sample:
                token = result.sampled_token_ids[seq.request_id]
                request.token_ids.append(token)
                stop_status = self._stop_status(request, token)
                if stop_status is not None:
                    self._finish(request, stop_status)
                events.append(self._event(request, (token,)))
        return events

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        if token in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.geometry.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fail_all(self, message: str) -> list[TokenEvent]:
        """The executor failed: end every request with an error rather than leave it hanging."""
        events = []
        for request in list(self.requests.values()):
            event = self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
            if event is not None:
                events.append(TokenEvent(event.request_id, (), "error", event.num_prompt_tokens,
                                         event.num_output_tokens, event.num_cached_tokens, message))
        return events

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        self.blocks.free(request)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        if status == RequestStatus.FINISHED_ABORTED:
            self.counters.num_aborted += 1
        else:
            self.counters.num_finished += 1

    @staticmethod
    def _event(request: Request, new_tokens: tuple[int, ...]) -> TokenEvent:
        return TokenEvent(request.request_id, new_tokens, finish_reason(request.status),
                          request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
