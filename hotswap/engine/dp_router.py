"""Which data-parallel rank a new request goes to (`--dp-routing`, docs/design.md §2).

A multi-turn rollout resends its whole growing context every turn; the rank that served
the earlier turns holds their KV in its prefix cache, any other rank recomputes it. So:

- `least-loaded`: the rank with the fewest unfinished requests (keys are ignored).
- `session` (the default): a request carrying a session key (`X-Session-ID`, or the
  `session_id` argument) goes to the rank that served its session; a request without one,
  or a session's first, goes to the least-loaded rank.
- `cache-aware`: sessions as above; a request without a key goes to the rank whose cache
  most likely holds the longest prefix of its prompt (the prompts routed there, as block
  hashes, as sgl-router's cache-aware policy keeps them), if that covers at least half of
  the prompt.
- An explicit rank (vLLM's `X-data-parallel-rank` header) always wins.

A preferred rank is overloaded when it holds more unfinished requests than the least-loaded
rank by over max(4, half the least-loaded rank's), or holds `max_num_seqs` (new requests
would queue) while another has room: then the request spills to the least-loaded rank, and
its session moves there. The bound is relative because ranks step in parallel: a rank with
50% more work makes the whole batch of ranks wait for it. The
router only picks a rank; a wrong guess costs a recompute, never a wrong token (each rank's
cache is keyed by content and weight version).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from hotswap.config import DP_ROUTING, check_choice

MAX_SESSIONS = 1 << 16  # sessions remembered (least recently used forgotten first)
MIN_SPILL_MARGIN = 4  # requests beyond the least-loaded rank's that never count as overload
PREFIX_MATCH = 0.5  # cache-aware: the share of the prompt a rank must hold to be chosen


@dataclass
class RoutingStats:
    """Counters of the routing decisions (the front end's stats and `/metrics`)."""

    session_hits: int = 0  # a session's request sent to its rank
    session_moves: int = 0  # a session's request spilled: the session moved
    prefix_hits: int = 0  # cache-aware: sent to the rank holding its prefix
    pinned: int = 0  # an explicit rank
    routed: list[int] = field(default_factory=list)  # requests per rank, ever

    def as_dict(self) -> dict[str, object]:
        return {"dp_session_hits": self.session_hits, "dp_session_moves": self.session_moves,
                "dp_prefix_hits": self.prefix_hits, "dp_pinned": self.pinned,
                "dp_routed": list(self.routed)}  # fmt: skip


class DPRouter:
    """Picks a rank for each new request (see the module docstring); not thread-safe: the
    data-parallel client calls it under its lock."""

    def __init__(
        self, policy: str, num_ranks: int, max_num_seqs: int, block_size: int, blocks: int
    ) -> None:
        self.policy = check_choice("dp_routing", policy, DP_ROUTING)
        self.num_ranks = num_ranks
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        # cache-aware: per rank, the block hashes of prompts routed there, least recently
        # routed first, at most as many as the rank's KV cache has blocks
        self.prefixes = [_LRUSet(blocks) for _ in range(num_ranks)]
        self.stats = RoutingStats(routed=[0] * num_ranks)

    def choose(
        self, loads: list[int], session: str | None, pinned: int | None, tokens: list[int]
    ) -> int:
        """The rank for a request with this session key, explicit rank and prompt, given
        each rank's unfinished requests."""
        rank = self._pick(loads, session, pinned, tokens)
        self.stats.routed[rank] += 1
        if self.policy == "cache-aware":
            self.prefixes[rank].add_all(self._block_hashes(tokens))
        return rank

    def _pick(
        self, loads: list[int], session: str | None, pinned: int | None, tokens: list[int]
    ) -> int:
        if pinned is not None:
            self.stats.pinned += 1
            return pinned
        least = min(range(self.num_ranks), key=loads.__getitem__)
        if self.policy == "least-loaded":
            return least
        if session is not None:
            return self._session_rank(session, loads, least)
        if self.policy == "cache-aware":
            return self._prefix_rank(tokens, loads, least)
        return least

    def _session_rank(self, session: str, loads: list[int], least: int) -> int:
        owner = self.sessions.pop(session, None)
        if owner is None:
            rank = least
        elif self._overloaded(owner, loads, least):
            self.stats.session_moves += 1
            rank = least
        else:
            self.stats.session_hits += 1
            rank = owner
        self.sessions[session] = rank  # most recently used last
        if len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return rank

    def _prefix_rank(self, tokens: list[int], loads: list[int], least: int) -> int:
        hashes = self._block_hashes(tokens)
        if not hashes:
            return least
        held = [self.prefixes[rank].leading(hashes) for rank in range(self.num_ranks)]
        best = max(range(self.num_ranks), key=lambda r: (held[r], -loads[r]))
        if held[best] < PREFIX_MATCH * len(hashes) or self._overloaded(best, loads, least):
            return least
        self.stats.prefix_hits += 1
        return best

    def _overloaded(self, rank: int, loads: list[int], least: int) -> bool:
        if loads[rank] - loads[least] > max(MIN_SPILL_MARGIN, loads[least] // 2):
            return True
        return loads[rank] >= self.max_num_seqs > loads[least]

    def _block_hashes(self, tokens: list[int]) -> list[int]:
        """One hash per whole block of the prompt, each of the prefix up to its end."""
        hashes, previous = [], 0
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            previous = hash((previous, *tokens[end - self.block_size : end]))
            hashes.append(previous)
        return hashes


class _LRUSet:
    """A bounded set of block hashes, the least recently added dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.items: collections.OrderedDict[int, None] = collections.OrderedDict()

    def add_all(self, hashes: list[int]) -> None:
        for value in hashes:
            self.items[value] = None
            self.items.move_to_end(value)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def leading(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, are held."""
        count = 0
        for value in hashes:
            if value not in self.items:
                break
            count += 1
        return count
