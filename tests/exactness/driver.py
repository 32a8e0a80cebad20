"""Plays a schedule against an engine (the Python API or the HTTP server, behind one small
interface) and returns what every choice received, with the ledger of committed weights.

Invariants: steps run in order, each awaited before the next (a request's stream runs in
the background from its Submit on); a step that makes no sense in the current state is
skipped, never forced (waiting on a frozen, asleep or weightless engine, or for a `wait`
pause then; a round while the weights sleep; a partial round onto weights that are
unknown), so every subsequence
of a schedule plays; the driver never sleeps for a state, it waits on one, within a
deadline whose expiry is a `hang` failure; after the last step it wakes, reloads missing
weights, resumes and waits for every request, so every choice ends.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from tests.exactness.check import Failure, Observed, Span
from tests.exactness.schedule import (
    Await,
    LoadAdapter,
    Pause,
    Resume,
    Round,
    Schedule,
    Sleep,
    Step,
    Submit,
    Wake,
    describe_step,
)
from tests.exactness.trainer import Trainer
from tests.exactness.weights import UNKNOWN, Ledger, WeightBank, WeightState, plan_round
from tests.helpers.waiting import until

AWAIT_TIMEOUT_S = 30.0  # a request's progress while the engine runs
STEP_TIMEOUT_S = 60.0  # any other step (a pause, a round, a sleep)
FINISH_TIMEOUT_S = 60.0  # every request's end, once the schedule is played


@dataclass
class ChoiceSoFar:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    experts: np.ndarray | None = None


class Stream:
    """One request's choices as they grow; an engine's consumer task fills them."""

    def __init__(self, request: Submit, lora_name: str | None) -> None:
        self.request = request
        self.lora_name = lora_name
        self.choices = [ChoiceSoFar() for _ in range(request.n)]
        self.task: asyncio.Task | None = None
        self.submitted_version = 0
        self.aborts_at_submit = 0

    @property
    def num_tokens(self) -> int:
        return max(len(c.tokens) for c in self.choices)

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()


class Engine(Protocol):
    """What a driver needs of an engine; each call returns once the engine has done it."""

    eos_token_id: int
    trainer: Trainer

    async def start(self) -> int: ...  # the committed version a schedule starts from
    def submit(self, stream: Stream, adapter: tuple[str, int] | None) -> None: ...
    def experts_expected(self, request: Submit) -> bool: ...
    async def pause(self, mode: str, clear_cache: bool) -> None: ...
    async def resume(self) -> None: ...
    async def sleep(self, level: int, mode: str) -> None: ...
    async def wake(self) -> None: ...
    async def load_adapter(self, name: str, path: Path, inplace: bool) -> None: ...
    async def load_from_disk(self, path: Path, label: str) -> None: ...
    async def relabel(self, label: str) -> None: ...
    async def version(self) -> int: ...
    async def counters(self) -> dict[str, int]: ...  # the schedule's preemptions, ...
    async def finish(self) -> None: ...  # after a schedule: release what it loaded


@dataclass
class Outcome:
    observed: list[Observed]
    failures: list[Failure]
    ledger: Ledger
    events: Counter[str]  # what was played, and what the engine counted (preemptions)


class Driver:
    def __init__(self, schedule: Schedule, engine: Engine, bank: WeightBank) -> None:
        self.schedule, self.engine, self.bank = schedule, engine, bank
        self.arch = schedule.engine.arch
        self.fp8 = schedule.engine.fp8
        self.streams: dict[str, Stream] = {}
        self.ledger: Ledger | None = None
        self.paused = self.asleep = self.weights_missing = False
        self.resume_on_wake = True
        self.sleep_level = 0
        self.aborts = 0
        self.slots: dict[int, str] = {}  # LoRA slot -> its adapter name, once loaded
        self.events: Counter[str] = Counter()  # steps played (not skipped), by kind

    async def run(self) -> Outcome:
        start = await self.engine.start()
        self.ledger = Ledger.starting(start, self.bank.state(self.arch, 0, self.fp8))
        failures: list[Failure] = []
        for number, step in enumerate(self.schedule.steps, 1):
            where = f"step {number} ({describe_step(step)})"
            failure = await self._guarded(self._apply(step), where, STEP_TIMEOUT_S)
            if failure is not None:
                failures.append(failure)
                break
        if not failures:
            end = STEP_TIMEOUT_S + FINISH_TIMEOUT_S
            failure = await self._guarded(self._finalize(), "the end of the schedule", end)
            failures += [failure] if failure is not None else []
        observed = [] if failures else self._observed()
        await self._cancel_streams()
        if not failures:
            self.events.update(await self.engine.counters())
        await self.engine.finish()
        return Outcome(observed, failures, self.ledger, self.events)

    async def _cancel_streams(self) -> None:
        """After a failure, streams may still be waiting: end them, quietly."""
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _guarded(self, action, where: str, timeout_s: float) -> Failure | None:  # noqa: ANN001
        try:
            await asyncio.wait_for(action, timeout_s)
        except AssertionError as e:  # a deadline passed (tests.helpers.waiting)
            return Failure("hang", f"{where}: {e}")
        except TimeoutError:
            return Failure("hang", f"{where}: did not return within {timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - any engine error fails the schedule
            return Failure("error", f"{where}: {type(e).__name__}: {e}")
        return None

    # -- steps ----------------------------------------------------------------------------
    async def _apply(self, step: Step) -> None:
        """Play one step, counting it under its event name unless it was skipped."""
        if isinstance(step, Pause) and not self._may_wait(step.mode):
            return
        if isinstance(step, Pause):
            await self.engine.pause(step.mode, step.clear_cache)
            self.paused = True
            self.aborts += step.mode == "abort"
            applied: str | None = f"pause {step.mode}" + " clear_cache" * step.clear_cache
        elif isinstance(step, Resume):
            await self.engine.resume()
            self.resume_on_wake = True  # while asleep, the resume waits for the wake
            self.paused, applied = self.asleep, "resume"
        else:
            handlers = {
                Submit: self._submit,
                Await: self._await,
                Round: self._round,
                Sleep: self._sleep,
                Wake: self._wake,
                LoadAdapter: self._load_adapter,
            }
            applied = await handlers[type(step)](step)
        if applied:
            self.events[applied] += 1

    async def _submit(self, step: Submit) -> str | None:
        if step.key in self.streams:
            return None
        adapter = None
        if step.adapter is not None and self.schedule.engine.lora:
            if step.adapter not in self.slots:
                loaded = await self._load_adapter(LoadAdapter(step.adapter, step.adapter))
                self.events[loaded or "adapter load skipped"] += 1
            name = self.slots.get(step.adapter)
            adapter = None if name is None else (name, step.adapter)
        stream = Stream(step, None if adapter is None else adapter[0])
        stream.submitted_version = self.ledger.current
        stream.aborts_at_submit = self.aborts
        self.engine.submit(stream, adapter)
        self.streams[step.key] = stream
        return "request"

    async def _await(self, step: Await) -> str | None:
        stream = self.streams.get(step.key)
        if stream is None or self.paused or self.asleep or self.weights_missing:
            return None
        await until(
            lambda: stream.done or stream.num_tokens >= step.tokens,
            f"{step.key} has {step.tokens} tokens",
            AWAIT_TIMEOUT_S,
        )
        return "await"

    async def _load_adapter(self, step: LoadAdapter) -> str | None:
        if not self.schedule.engine.lora or self.asleep:
            return None
        name = self.slots.get(step.slot, f"lora{step.slot}")
        path = self.bank.adapter_dir(step.adapter)
        reload = step.slot in self.slots
        await self.engine.load_adapter(name, path, inplace=reload)
        self.slots[step.slot] = name
        self.ledger.load_adapter(name, path)
        return "adapter reload" if reload else "adapter load"

    def _may_wait(self, mode: str) -> bool:
        """A `wait` pause (or sleep) waits for started requests to finish, which they
        cannot while the weights are missing (after a level-2 sleep, until a whole model
        is loaded): the engine refuses it then (tests/engine/test_sleep.py), so the
        schedule skips it."""
        return mode != "wait" or not self.weights_missing

    async def _sleep(self, step: Sleep) -> str | None:
        if self.asleep or not self._may_wait(step.mode):
            return None
        await self.engine.sleep(step.level, step.mode)
        # a sleep is a pause; one made before it survives the wake
        self.resume_on_wake, self.paused = not self.paused, True
        self.asleep, self.sleep_level = True, step.level
        self.aborts += step.mode == "abort"
        return f"sleep level {step.level}"

    async def _wake(self, step: Wake | None = None) -> str | None:
        if not self.asleep:
            return None
        await self.engine.wake()
        self.asleep = False
        self.weights_missing |= self.sleep_level == 2
        self.paused = not self.resume_on_wake
        return "wake"

    # -- weight rounds --------------------------------------------------------------------
    async def _round(self, step: Round) -> str | None:
        if self.asleep and self.sleep_level >= 1:
            return None  # weights asleep: every write is refused
        current = UNKNOWN if self.weights_missing else self.ledger.state
        deltas = ("partial", "sparse")
        if self.schedule.engine.backend == "sparse":
            deltas += ("whole", "aborted")  # only a disk reload restores unknown weights
        if current.tensors is None and step.kind in deltas:
            return None
        planned = plan_round(step, current, self.bank, self.arch, self.fp8)
        label = f"v{self.ledger.current + 1}-{step.kind}"
        before = await self.engine.version()
        await self._send(step, planned, current, label)
        after = await self.engine.version()
        if step.kind == "aborted":
            if after != before:
                raise RoundError(f"an aborted round committed version {after}")
            return "round aborted"
        if after != before + 1:
            raise RoundError(f"a {step.kind} round moved the version {before} -> {after}")
        whole = step.kind in ("disk", "whole")
        state = planned.after if whole or not self.weights_missing else UNKNOWN
        self.weights_missing = self.weights_missing and not whole
        self.ledger.commit(after, state, step.kind)
        policy = f" kv_policy {step.kv_policy}" if step.kv_policy else ""
        in_flight = " in flight" if self.schedule.engine.in_flight and not self.paused else ""
        return f"round {step.kind}{in_flight}{policy}"

    async def _send(self, step: Round, planned, current: WeightState, label: str) -> None:  # noqa: ANN001
        trainer = self.engine.trainer
        if step.kind == "disk":
            await self.engine.load_from_disk(planned.directory, label)
        elif step.kind == "relabel":
            await self.engine.relabel(label)
        elif step.kind == "aborted":
            await asyncio.to_thread(trainer.abort, planned, label)
        else:
            await asyncio.to_thread(trainer.send, planned, current, label, step.kv_policy)

    # -- the end --------------------------------------------------------------------------
    async def _finalize(self) -> None:
        await self._wake()
        if self.weights_missing:
            await self.engine.load_from_disk(self.bank.model_dir(self.arch), "reloaded")
            reloaded = self.bank.state(self.arch, 0, self.fp8)
            self.ledger.commit(await self.engine.version(), reloaded, "disk")
            self.weights_missing = False
        await self.engine.resume()
        self.paused = False
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=FINISH_TIMEOUT_S)
            if pending:
                keys = [s.request.key for s in self.streams.values() if not s.done]
                raise AssertionError(f"requests {keys} never finished")
            for task in done:
                task.result()  # a stream's error fails the schedule

    def _observed(self) -> list[Observed]:
        out = []
        for stream in self.streams.values():
            for index, choice in enumerate(stream.choices):
                out.append(
                    Observed(
                        request=stream.request,
                        index=index,
                        prompt=stream.request.prompt,
                        tokens=tuple(choice.tokens),
                        logprobs=tuple(choice.logprobs),
                        spans=tuple(choice.spans),
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                        text=choice.text,
                        experts=choice.experts,
                        experts_expected=self.engine.experts_expected(stream.request),
                        submitted_version=stream.submitted_version,
                        may_abort=self.aborts > stream.aborts_at_submit,
                        lora_name=stream.lora_name,
                    )
                )
        return out


class RoundError(RuntimeError):
    """A round committed what it should not have (or did not commit)."""
