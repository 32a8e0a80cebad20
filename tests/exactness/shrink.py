"""Shrinking a failing schedule to a small one that still fails the same way.

Greedy and budgeted: candidates come simplest-first (drop chunks of steps, halving the
chunk; then simplify one request, wait, round or the engine), the first candidate that
still fails with the same kind of failure becomes the schedule, and the search restarts
from it, until no candidate fails or the time budget is spent. Timing varies from run to
run, so a candidate is judged on one run: the result is small, not necessarily minimal.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.exactness.check import Failure
from tests.exactness.schedule import Await, Round, Schedule, Submit


@dataclass(frozen=True)
class Shrunk:
    schedule: Schedule
    failure: Failure
    runs: int
    seconds: float


def shrink(
    schedule: Schedule,
    failure: Failure,
    run: Callable[[Schedule], list[Failure]],
    budget_s: float,
    engines: bool = True,
) -> Shrunk:
    """`engines`: also try simpler engines (each a new server over HTTP: off there)."""
    start = time.monotonic()
    best, best_failure, runs = schedule, failure, 0
    improved = True
    while improved:
        improved = False
        for candidate in candidates(best, engines):
            if time.monotonic() - start > budget_s:
                return Shrunk(best, best_failure, runs, time.monotonic() - start)
            runs += 1
            failures = run(candidate)
            if failures and failures[0].kind == failure.kind:
                best, best_failure, improved = candidate, failures[0], True
                break
    return Shrunk(best, best_failure, runs, time.monotonic() - start)


def candidates(schedule: Schedule, engines: bool = True) -> Iterator[Schedule]:
    yield from _fewer_steps(schedule)
    for index, step in enumerate(schedule.steps):
        for simpler in _simpler_step(step):
            steps = list(schedule.steps)
            steps[index] = simpler
            yield dataclasses.replace(schedule, steps=tuple(steps))
    for engine in _simpler_engines(schedule) if engines else ():
        yield dataclasses.replace(schedule, engine=engine)


def _fewer_steps(schedule: Schedule) -> Iterator[Schedule]:
    steps = schedule.steps
    size = len(steps) // 2
    while size >= 1:
        for start in range(0, len(steps), size):
            kept = steps[:start] + steps[start + size :]
            if kept:
                yield dataclasses.replace(schedule, steps=kept)
        size //= 2


def _simpler_step(step: object) -> Iterator[object]:
    if isinstance(step, Submit):
        yield from _simpler_request(step)
    elif isinstance(step, Await) and step.tokens > 1:
        yield dataclasses.replace(step, tokens=step.tokens // 2)
    elif isinstance(step, Round) and step.kv_policy is not None:
        yield dataclasses.replace(step, kv_policy=None)


def _simpler_request(step: Submit) -> Iterator[Submit]:
    replace = dataclasses.replace
    if step.n > 1:
        yield replace(step, n=1)
    if step.seed is not None:
        yield replace(step, seed=None)
    if step.stop:
        yield replace(step, stop=())
    if not step.ignore_eos:
        yield replace(step, ignore_eos=True)
    if step.adapter is not None:
        yield replace(step, adapter=None)
    if step.max_tokens > 1:
        yield replace(step, max_tokens=step.max_tokens // 2)
        yield replace(step, max_tokens=step.max_tokens - 1)
    prompt = step.prompt
    if len(prompt) > 1:
        half = len(prompt) // 2
        yield replace(step, prompt=prompt[:half])
        yield replace(step, prompt=prompt[half:])
        yield replace(step, prompt=prompt[:-1])


def _simpler_engines(schedule: Schedule) -> Iterator[object]:
    spec = schedule.engine
    replace = dataclasses.replace
    if spec.in_flight:
        yield replace(spec, in_flight=False)
    if spec.double_buffer:
        yield replace(spec, double_buffer=False)
    if spec.kv_policy != "keep":
        yield replace(spec, kv_policy="keep")
    if spec.lora and not any(
        isinstance(s, Submit) and s.adapter is not None for s in schedule.steps
    ):
        yield replace(spec, lora=False)
    if spec.max_num_batched_tokens < 2048:
        yield replace(spec, max_num_batched_tokens=2048)
    if spec.num_kv_blocks * spec.block_size < 512:
        yield replace(spec, num_kv_blocks=512 // spec.block_size)
