"""Waiting-queue order behind a small protocol, with a factory (FCFS now; fair queues plug in here)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from scheduling.request import Request


class RequestQueue(Protocol):
    """Orders waiting requests. `prepend` puts a preempted request back at the head."""

    def add(self, request: Request) -> None: ...

    def prepend(self, request: Request) -> None: ...

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def prepend(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"unknown queue policy '{policy}'")
