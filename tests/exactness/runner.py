"""The checker's loop: random schedules from a seed, each played and checked, until the
budget is spent or a schedule fails; a failure is shrunk and reported with the schedule
to replay it. Reports how many schedules, tokens and expert rows were checked, and the
rates per minute."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.exactness.check import Context, Failure, Tally, check_choice
from tests.exactness.driver import Driver
from tests.exactness.generate import HTTP_SPECS, random_schedule
from tests.exactness.reference import Reference
from tests.exactness.schedule import EngineSpec, Schedule
from tests.exactness.shrink import Shrunk, shrink
from tests.exactness.weights import WeightBank

HTTP_RUN = 12  # schedules in a row on one server


@dataclass(frozen=True)
class Budget:
    seconds: float
    schedules: int | None = None  # at most this many, if given

    def spent(self, elapsed: float, schedules: int) -> bool:
        return elapsed >= self.seconds or (
            self.schedules is not None and schedules >= self.schedules
        )


@dataclass(frozen=True)
class Found:
    """A failing schedule, where it came from, and its shrunk form."""

    seed: int
    number: int  # the schedule's place in the seed's sequence (1-based)
    original: Schedule
    failure: Failure
    shrunk: Shrunk

    def describe(self, transport: str) -> str:
        small = self.shrunk.schedule
        lines = [
            f"exactness FAILED: schedule {self.number} of seed {self.seed} ({transport})",
            f"  {self.failure.kind}: {self.failure.message}",
            f"minimal schedule ({len(self.original.steps)} steps shrunk to {len(small.steps)} "
            f"in {self.shrunk.runs} runs, {self.shrunk.seconds:.1f} s), failing with",
            f"  {self.shrunk.failure.kind}: {self.shrunk.failure.message}",
            small.describe(),
            "replay:",
            f"  python -m tests.exactness --transport {transport} --replay '{small.to_json()}'",
        ]
        return "\n".join(lines)


@dataclass
class Report:
    transport: str
    seed: int
    schedules: int = 0
    seconds: float = 0.0
    tally: Tally = field(default_factory=Tally)
    found: Found | None = None

    def summary(self) -> str:
        t, minutes = self.tally, max(self.seconds, 1e-9) / 60
        head = (
            f"exactness ({self.transport}, seed {self.seed}): {self.schedules} schedules, "
            f"{t.tokens} tokens checked against the reference ({t.greedy} greedy, "
            f"{t.near_ties} near ties), {t.stale} stale tokens span-checked, "
            f"{t.expert_rows} routed-expert rows, in {self.seconds:.1f} s: "
            f"{self.schedules / minutes:.1f} schedules/min, {t.tokens / minutes:.0f} tokens/min"
        )
        events = ", ".join(f"{name} {count}" for name, count in sorted(t.events.items()) if count)
        tail = "no failure" if self.found is None else self.found.describe(self.transport)
        return f"{head}\ncovered: {events}\n{tail}"


class Checker:
    """Plays schedules through one transport ("python" or "http") and checks them."""

    def __init__(self, bank: WeightBank, transport: str = "python") -> None:
        from transformers import AutoConfig

        self.bank, self.transport = bank, transport
        configs = {a: AutoConfig.from_pretrained(bank.model_dir(a)) for a in ("llama", "qwen3_moe")}
        self.reference = Reference(configs)
        self.pool = None
        if transport == "http":
            from tests.exactness.http_engine import ServerPool

            self.pool = ServerPool(bank)
        self._numbers = 0

    def engine(self, schedule: Schedule):  # noqa: ANN201 - an Engine
        if self.pool is not None:
            from tests.exactness.http_engine import HttpEngine

            self._numbers += 1
            return HttpEngine(self.pool, schedule.engine, self.bank, self._numbers)
        from tests.exactness.python_engine import PythonEngine

        return PythonEngine(schedule.engine, self.bank)

    def check(self, schedule: Schedule, tally: Tally | None = None) -> list[Failure]:
        """Play `schedule` and check every choice; the first failure(s), [] if none."""
        engine = self.engine(schedule)
        outcome = asyncio.run(Driver(schedule, engine, self.bank).run())
        if outcome.failures:
            return outcome.failures
        ctx = Context(
            schedule.engine.arch,
            outcome.ledger,
            self.reference,
            engine.eos_token_id,
            schedule.engine.max_model_len,
            schedule.engine.kv_fp8,
        )
        counted = Tally(events=outcome.events)
        counted.events.update(engine_features(schedule.engine))
        for observed in outcome.observed:
            failures = check_choice(observed, ctx, counted)
            if failures:
                return failures
        if tally is not None:
            tally.add(counted)
        return []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def run(
    checker: Checker,
    seed: int,
    budget: Budget,
    shrink_budget_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> Report:
    rng = random.Random(seed)
    report = Report(checker.transport, seed)
    start = time.monotonic()
    while not budget.spent(time.monotonic() - start, report.schedules):
        schedule = random_schedule(rng, checker.transport, _http_spec(checker, report.schedules))
        failures = checker.check(schedule, report.tally)
        report.schedules += 1
        report.seconds = time.monotonic() - start
        if progress is not None:
            progress(f"schedule {report.schedules}: {'FAILED' if failures else 'ok'}")
        if failures:
            engines = checker.transport != "http"
            shrunk = shrink(schedule, failures[0], checker.check, shrink_budget_s, engines)
            report.found = Found(seed, report.schedules, schedule, failures[0], shrunk)
            break
    return report


def engine_features(spec: EngineSpec) -> list[str]:
    """The engine's features a report counts schedules by."""
    features = {
        "mixture of experts": spec.moe,
        "LoRA": spec.lora,
        "FP8 weights": spec.fp8,
        "an FP8 KV cache": spec.kv_fp8,
        "sparse backend": spec.backend == "sparse",
        "in-flight rounds": spec.in_flight,
        "double buffer": spec.double_buffer,
        "chunked prefill": spec.max_num_batched_tokens < 512,
        "few KV blocks": spec.num_kv_blocks * spec.block_size <= 128,
        "priority scheduling": spec.scheduling_policy == "priority",
    }
    return [f"engines with {name}" for name, present in features.items() if present]


def _http_spec(checker: Checker, number: int):  # noqa: ANN202
    """Over HTTP a server runs per engine: runs of `HTTP_RUN` schedules share one."""
    if checker.transport != "http":
        return None
    return HTTP_SPECS[(number // HTTP_RUN) % len(HTTP_SPECS)]


def replay(checker: Checker, schedule: Schedule) -> tuple[list[Failure], Tally]:
    tally = Tally()
    return checker.check(schedule, tally), tally
