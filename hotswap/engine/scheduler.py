"""Continuous batching: each step picks which requests compute how many tokens.

Invariants: every request in `running` holds KV blocks for its computed tokens; every
request in `waiting` holds none. Running requests are served first (in admission order);
when blocks run out a running request is preempted by recompute: the newest under the
fcfs policy, the one with the largest (priority, arrival) under priority, as in vLLM.
Waiting requests are admitted in the policy's order (request_queue.py); a waiting request
never preempts a running one. The pause state gates what may be scheduled
(docs/design.md §3).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from hotswap.config import CacheConfig, SchedulerConfig
from hotswap.engine.kv_cache import KVCacheManager
from hotswap.engine.request import Request, RequestStatus
from hotswap.engine.request_queue import lowest_priority, make_waiting_queue


class PauseState(enum.IntEnum):
    UNPAUSED = 0
    PAUSED_NEW = 1  # no new request is admitted; running ones go on
    PAUSED_ALL = 2  # nothing is scheduled


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens when scheduled: tokens [start, start+num_tokens) run
    num_tokens: int
    # True when this chunk reaches the last known token, so its logits are sampled.
    # Fixed at scheduling time: the request grows once the sampled token is appended.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct adapters among running requests (LoRA)
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.waiting = make_waiting_queue(config.policy)
        self._arrivals = itertools.count()  # Request.arrival_order
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pause_state = PauseState.UNPAUSED
        self.num_preemptions = 0
        self._prefill_budget = config.max_num_batched_tokens

    # -- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt: {request.num_tokens} tokens leave no room to generate within "
                f"max_model_len={self.config.max_model_len}"
            )
        self.requests[request.request_id] = request
        request.arrival_order = next(self._arrivals)
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def set_pause_state(self, state: PauseState) -> None:
        self.pause_state = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step could schedule anything in the current pause state."""
        if self.pause_state == PauseState.PAUSED_ALL:
            return False
        if self.pause_state == PauseState.PAUSED_NEW:
            return self.has_started_requests()
        return bool(self.requests)

    def has_started_requests(self) -> bool:
        """Running requests, including preempted ones waiting to be recomputed."""
        return bool(self.running) or any(r.status == RequestStatus.PREEMPTED for r in self.waiting)

    def drop_running_kv(self) -> int:
        """Free the KV of every running request (frozen by a pause); they recompute their
        prompt and output so far when scheduled again, ahead of new requests."""
        dropped = self.running[::-1]
        for request in dropped:
            self._preempt(request, count=False)
        self.running = []
        return len(dropped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.pause_state == PauseState.PAUSED_ALL:
            return out
        self._prefill_budget = self._prefill_cap()
        self.kv.pool.expire(time.monotonic())
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # As vLLM: a step that had to preempt admits nothing. Its victims wait first in
        # line, and their blocks, still cached, would let one come straight back in the
        # same step, scheduled and preempted at once.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _prefill_cap(self) -> int:
        cap = self.config.max_prefill_tokens_while_decoding
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return cap if cap is not None and decoding else self.config.max_num_batched_tokens

    def _take_prefill(self, wanted: int, budget: int) -> int:
        """Tokens a prefill chunk may have this step (decodes are never capped)."""
        granted = min(wanted, budget, self._prefill_budget)
        self._prefill_budget -= granted
        return granted

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = request.num_tokens - request.num_computed_tokens
            num_new = min(num_new, budget) if num_new == 1 else self._take_prefill(num_new, budget)
            if num_new == 0:
                index += 1
                continue
            while not self.kv.can_allocate(request, num_new):
                victim, budget, index = self._pick_victim(out, budget, index)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            self.kv.allocate(request, num_new)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
            index += 1
        return budget

    def _pick_victim(
        self, out: SchedulerOutput, budget: int, index: int
    ) -> tuple[Request, int, int]:
        """Take the request to preempt out of `running`. fcfs: the newest, never one
        scheduled this step (it is behind `index`). priority: the largest key, maybe one
        scheduled already: its chunk is taken back (its budget and prefill-cap share
        returned; the caller's `index` moves back past it), as vLLM does."""
        if self.config.policy != "priority":
            return self.running.pop(), budget, index
        victim = lowest_priority(self.running)
        position = self.running.index(victim)
        del self.running[position]
        if position < index:
            item = next(s for s in out.scheduled if s.request is victim)
            out.scheduled.remove(item)
            self.kv.unschedule(victim, item.start)
            budget += item.num_tokens
            if victim.num_tokens - item.start != 1:  # a prefill chunk: it took from the cap
                self._prefill_budget += item.num_tokens
            index -= 1
        return victim, budget, index

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        adapters = self.running_adapters()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._may_admit(request) or not self._adapter_fits(request, adapters):
                skipped.append(self.waiting.pop())
                continue
            num_new = self._admit(request, budget)
            if num_new == 0:
                break
            if request.lora is not None:
                adapters.add(request.lora.uid)
            self.waiting.pop()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        self.waiting.restore(skipped)

    def _may_admit(self, request: Request) -> bool:
        if self.pause_state == PauseState.UNPAUSED:
            return True
        # Under PAUSED_NEW a preempted request was already running: it must be able to
        # finish, or a pause in `wait` mode would never complete.
        return request.status == RequestStatus.PREEMPTED

    def running_adapters(self) -> set[int]:
        return {r.lora.uid for r in self.running if r.lora is not None}

    def _adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """At most `max_loras` distinct adapters run at once (each needs a slot); a request
        whose adapter has none waits, as in vLLM."""
        if request.lora is None or self.max_loras is None or request.lora.uid in adapters:
            return True
        return len(adapters) < self.max_loras

    def _admit(self, request: Request, budget: int) -> int:
        """Allocate blocks for the request's first chunk; 0 if it cannot start now."""
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        num_new = min(num_new, budget, self._prefill_budget)
        if num_new == 0 or not self.kv.can_allocate(request, num_new, computed_blocks):
            return 0
        self._prefill_budget -= num_new
        request.kv_version = self.kv.weight_version  # its KV is computed afresh from here
        if request.start_version is None:
            request.start_version = self.kv.weight_version
        self.kv.allocate(request, num_new, computed_blocks)
        request.num_computed_tokens = num_cached
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        return num_new

    def make_room(self, num_blocks: int) -> None:
        """Preempt running requests (newest first; lowest priority first under the
        priority policy) until `num_blocks` blocks are free, for work outside a step
        (engine/scoring.py). Preempting all of them frees every block."""
        while not self.kv.pool.can_allocate(num_blocks) and self.running:
            priority = self.config.policy == "priority"
            victim = lowest_priority(self.running) if priority else self.running[-1]
            self.running.remove(victim)
            self._preempt(victim)

    def _preempt(self, request: Request, count: bool = True) -> None:
        self.kv.free(request)
        request.reset_for_recompute()
        request.status = RequestStatus.PREEMPTED
        if count:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.push_front(request)

    # -- after the model ran ------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that stop.
        Returns the requests that got a new token or finished."""
        changed = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # finished while the step ran (e.g. aborted)
                continue
            request.num_computed_tokens = item.start + item.num_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a partial prefill chunk: nothing sampled yet
            request.append_output_token(token)
            self._check_stop(request, token)
            changed.append(request)
        return changed

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                self._finish_running(request, RequestStatus.FINISHED_STOPPED)
                return
            if token in request.stop_token_ids:
                request.stop_reason = token
                self._finish_running(request, RequestStatus.FINISHED_STOPPED)
                return
        if (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ) or request.num_tokens >= self.config.max_model_len:
            self._finish_running(request, RequestStatus.FINISHED_LENGTH)

    def _finish_running(self, request: Request, status: RequestStatus) -> None:
        self.running.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        retain = request.kv_retention_s  # kept for its session's next turn (kv_cache.py)
        self.kv.free(request, time.monotonic() + retain if retain > 0 else None)
        request.status = status
        del self.requests[request.request_id]
