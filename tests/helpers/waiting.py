"""Waiting for a state instead of sleeping for it: poll a condition until it holds, within a
deadline that fails the test (naming what never happened) rather than hanging it.

Invariant: each helper returns as soon as the condition holds (the condition's true value),
and raises AssertionError once `timeout_s` has passed without it; it never returns on time
alone."""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

T = TypeVar("T")
POLL_S = 0.01


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 30.0) -> T:
    """Poll `condition` until it returns a true value; that value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting until {what}"
        time.sleep(POLL_S)
    return value


async def until(condition: Callable[[], Awaitable[T] | T], what: str, timeout_s: float = 30.0) -> T:
    """`wait_until` inside an event loop: the loop keeps running between polls, and a
    condition may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting until {what}"
        await asyncio.sleep(POLL_S)


def gauge(metrics: str, name: str) -> float:
    """The value of an unlabelled or single-series gauge in a /metrics page (0 if absent)."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def requests_waiting(http: httpx.AsyncClient) -> float:
    """hotswap:num_requests_waiting as the server reports it now (every rank's summed)."""
    return gauge((await http.get("/metrics")).text, "hotswap:num_requests_waiting")
