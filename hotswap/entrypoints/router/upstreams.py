"""The router's pure parts: which upstream a request goes to, and what it is hashed by.

The choice is the data-parallel front end's (engine/dp_router.py, `--dp-routing`) with
upstream servers for ranks and, for loads, the requests the router has in flight on each.
A request's hints are read as `hotswap serve` reads them (server/routing.py): the session
key from `X-Session-ID`, else the body's `session_id`, else SGLang's `routing_key`; an
explicit choice from `X-data-parallel-rank`, which at the router is an upstream's index
(the body's own `data_parallel_rank` passes through: it is a rank inside that upstream).

Cache-aware routing hashes the prompt's token ids where the body has them
(/inference/v1/generate's `token_ids`, SGLang's `input_ids`, a completions prompt of token
ids) and otherwise the UTF-8 bytes of the prompt text or of the chat messages' JSON: an
approximation (a byte block is not a KV block), enough to send a repeated prefix back to
the server that saw it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hotswap.engine.dp_router import DPRouter, RoutingStats
from hotswap.engine.prompts import MAX_SESSION_ID_CHARS, is_session_id

SESSION_HEADER = "X-Session-ID"
RANK_HEADER = "X-data-parallel-rank"
UPSTREAM_HEADER = "X-Hotswap-Upstream"  # the answer's: which upstream served it
# No upstream's max_num_seqs is known here: only the relative spill bound applies.
UNBOUNDED = 1 << 30
HASH_BLOCK = 16  # tokens (or bytes) per hashed block
HASH_BLOCKS = 1 << 16  # blocks remembered per upstream
# An upstream that refused a connection is routed around this long, then tried again.
DOWN_S = 5.0


class RoutingError(ValueError):
    """A hint the router refuses (a 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Hints:
    session: str | None = None
    pinned: int | None = None


def request_hints(headers: Any, body: object, num_upstreams: int) -> Hints:
    """The session key and pinned upstream of a request (`headers`: a case-insensitive
    mapping; `body`: its parsed JSON, or None)."""
    session = headers.get(SESSION_HEADER)
    if session is not None and not is_session_id(session):
        raise RoutingError(f"{SESSION_HEADER}: must be 1 to {MAX_SESSION_ID_CHARS} characters",
                           SESSION_HEADER)  # fmt: skip
    if session is None and isinstance(body, dict):
        for name in ("session_id", "routing_key"):
            if isinstance(body.get(name), str) and body[name]:
                session = body[name]
                break
    pinned = None
    text = headers.get(RANK_HEADER)
    if text is not None and text.strip().lstrip("+-").isdigit():  # else ignored, as vLLM
        pinned = int(text)
        if not 0 <= pinned < num_upstreams:
            message = f"{RANK_HEADER}: {pinned} is out of range [0, {num_upstreams})"
            raise RoutingError(message + " (at the router: an upstream's index)", RANK_HEADER)
    return Hints(session, pinned)


def prompt_key(body: object) -> list[int]:
    """What cache-aware routing hashes: the prompt's token ids if the body has them, else
    the bytes of its text (see the module docstring); [] when it has no prompt."""
    if not isinstance(body, dict):
        return []
    for name in ("token_ids", "input_ids", "prompt"):
        value = body.get(name)
        if _token_ids(value):
            return list(value)
    for name in ("prompt", "text"):
        if isinstance(body.get(name), str):
            return list(body[name].encode())
    if "messages" in body:
        return list(json.dumps(body["messages"], sort_keys=True).encode())
    return []


def _token_ids(value: object) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))  # fmt: skip


class Balancer:
    """The upstream for each request, and each upstream's requests in flight."""

    def __init__(self, policy: str, num_upstreams: int) -> None:
        self.router = DPRouter(policy, num_upstreams, UNBOUNDED, HASH_BLOCK, HASH_BLOCKS)
        self.in_flight = [0] * num_upstreams
        self.down_until = [0.0] * num_upstreams  # time.monotonic() a refusal's cooldown ends

    @property
    def stats(self) -> RoutingStats:
        return self.router.stats

    def acquire(self, hints: Hints, key: list[int], now: float | None = None) -> int:
        """The upstream for a request, counted in flight there until `release`. An
        upstream cooling down after a refused connection counts as full, so only a pin
        sends a request there while another is up (a session on it moves)."""
        now = time.monotonic() if now is None else now
        loads = [UNBOUNDED if self.down_until[i] > now else n
                 for i, n in enumerate(self.in_flight)]  # fmt: skip
        if all(load == UNBOUNDED for load in loads):
            loads = list(self.in_flight)  # all down: try them as they are
        index = self.router.choose(loads, hints.session, hints.pinned, key)
        self.in_flight[index] += 1
        return index

    def mark_down(self, index: int, now: float | None = None) -> None:
        """Upstream `index` refused a connection: route around it for DOWN_S."""
        self.down_until[index] = (time.monotonic() if now is None else now) + DOWN_S

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1


def prometheus_text(stats: RoutingStats, in_flight: list[int], urls: list[str]) -> str:
    """The router's counters in Prometheus' text format."""
    lines = []
    for name, value, kind in (
        ("session_hits", stats.session_hits, "counter"),
        ("session_moves", stats.session_moves, "counter"),
        ("prefix_hits", stats.prefix_hits, "counter"),
        ("pinned", stats.pinned, "counter"),
    ):
        lines += [f"# TYPE hotswap_router:{name} {kind}", f"hotswap_router:{name} {value}"]
    for name, values, kind in (("routed", stats.routed, "counter"),
                               ("in_flight", in_flight, "gauge")):  # fmt: skip
        lines.append(f"# TYPE hotswap_router:{name} {kind}")
        lines += [f'hotswap_router:{name}{{upstream="{i}",url="{url}"}} {value}'
                  for i, (url, value) in enumerate(zip(urls, values))]  # fmt: skip
    return "\n".join(lines) + "\n"
