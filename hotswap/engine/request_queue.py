"""The scheduler's waiting queue, one class per `--scheduling-policy` (vLLM's):

- fcfs: arrival order. A preempted request, or one skipped this step, goes back to the
  front: it was waiting before every request behind it.
- priority: by `priority_key` (lower priority first, then earlier arrival, then earlier
  add), whatever order requests enter in: a preempted or skipped request goes back to its
  place by its key, as vLLM's heap does.

Invariant (both): a request is in the queue at most once, and iteration, `peek` and `pop`
see the same requests.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from hotswap.engine.request import Request


def priority_key(request: Request) -> tuple[int, float, int]:
    """vLLM's (priority, arrival_time) order, ties broken by the order the scheduler
    added the requests in (the n samples of one prompt share an arrival time)."""
    return request.priority, request.arrival_time, request.arrival_order


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None:
        """A new request."""

    def push_front(self, request: Request) -> None:
        """A request that was ahead of the queue's (preempted, or skipped this step)."""

    def restore(self, skipped: list[Request]) -> None:
        """Put back requests popped and skipped this step, first popped first."""

    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def restore(self, skipped: list[Request]) -> None:
        self._queue.extendleft(reversed(skipped))

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A heap of (key, request); keys are unique (arrival_order is), so requests are
    never compared."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    # No front in a priority order: a request returns to its place by its key.
    push_front = add

    def restore(self, skipped: list[Request]) -> None:
        for request in skipped:
            self.add(request)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap, key=lambda e: e[0]))


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling_policy: unknown policy {policy!r}")


def lowest_priority(requests: Iterable[Request]) -> Request:
    """The request a priority scheduler preempts first: the largest key (vLLM's
    max(running, key=(priority, arrival_time)))."""
    return max(requests, key=priority_key)
