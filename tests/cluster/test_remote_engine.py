"""The ingress's engine (cluster/remote_engine.py) on a handle that answers as Ray Serve's does, without
Ray: every request it tracks ends once, whoever cancels its replica call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray.serve import context as serve_context

from cluster.remote_engine import ClusterEngine, RemoteExecutor
from cluster.wire import ReplicaCall
from contract.plan import CacheGeometry
from scheduling.request import Request, RequestId, TokenEvent
from tenancy.tenants import TenantRegistry
from tests.factories import wait_until

GEOMETRY = CacheGeometry(num_device_blocks=64, num_cpu_blocks=0, block_size=16, bytes_per_block=1024,
                         max_model_len=2048)


class Call:
    """A streaming replica call: one token event, then it either waits (a long generation) or raises
    CancelledError, as Ray Serve's response does when Serve cancels a cancelled request's child calls."""

    def __init__(self, call: ReplicaCall, cancelled_by_serve: bool) -> None:
        self._request = call.request
        self._cancelled_by_serve = cancelled_by_serve
        self.cancelled = False
        self.context_cancels_with_parent = serve_context._get_serve_request_context().cancel_on_parent_request_cancel

    def __aiter__(self) -> AsyncIterator[list[TokenEvent]]:
        return self._events()

    async def _events(self) -> AsyncIterator[list[TokenEvent]]:
        request = self._request
        yield [TokenEvent(request.request_id, (7,), None, request.num_prompt_tokens, 1, 0)]
        if self._cancelled_by_serve:
            raise asyncio.CancelledError
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, cancelled_by_serve: bool = False) -> None:
        self._cancelled_by_serve = cancelled_by_serve
        self.calls: list[Call] = []

    def remote(self, call: ReplicaCall) -> Call:
        self.calls.append(Call(call, self._cancelled_by_serve))
        return self.calls[-1]


def ingress(handle: Handle) -> ClusterEngine:
    return ClusterEngine(RemoteExecutor(GEOMETRY, lambda _: None), TenantRegistry.single_default(), handle,
                         board=None, max_queued_requests=16, batch_queue_fraction=0.75, stall_after_s=60,
                         report_max_age_s=10)


def request(request_id: str) -> Request:
    return Request(RequestId(request_id), list(range(40)), 100)


async def test_a_call_serve_cancels_ends_its_request_and_a_later_close_changes_nothing() -> None:
    engine = ingress(Handle(cancelled_by_serve=True))
    stream = engine.submit(request("r"))

    async with asyncio.timeout(5):  # before the fix the stream never ended
        events = [event async for event in stream]

    assert [event.is_final for event in events] == [False, True]
    assert events[-1].finish_reason == "abort" and events[-1].num_output_tokens == 1
    assert engine.num_unfinished == 0
    stream.close()
    assert engine.num_unfinished == 0


async def test_a_closed_stream_ends_once_and_cancels_its_call() -> None:
    handle = Handle()
    engine = ingress(handle)
    stream = engine.submit(request("r"))
    first = await anext(aiter(stream))
    assert first.new_token_ids == (7,)

    stream.close()

    assert engine.num_unfinished == 0
    await wait_until(lambda: handle.calls[0].cancelled, timeout=5)  # once the run's task takes its cancellation


async def test_replica_calls_are_not_the_submitting_requests_children() -> None:
    """Inside a Serve request whose children Serve would cancel with it, the replica call is made in a
    context of its own: only the ingress ends it."""
    handle = Handle()
    engine = ingress(handle)
    parent = serve_context._RequestContext(cancel_on_parent_request_cancel=True)
    serve_context._serve_request_context.set(parent)  # type: ignore[arg-type]  # typed by its default, None
    stream = engine.submit(request("r"))
    await anext(aiter(stream))

    assert handle.calls[0].context_cancels_with_parent is False
    stream.close()
