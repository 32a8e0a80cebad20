"""Sleep levels and wake tags (docs/design.md §3, spec "Sleep"): what each level puts to sleep,
the order in which parts may wake, and the engine core's sleep manager."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotswap.engine.errors import EngineStateError
from hotswap.engine.handlers import Deferred, Outputs, handles
from hotswap.engine.messages import EngineCoreOutput
from hotswap.engine.pause import PauseManager
from hotswap.engine.verbs import IsSleeping, Resume, Sleep, WakeUp, verb_name
from hotswap.execution.runner import ModelRunner
from hotswap.weights.sync import WeightSync

WEIGHTS, KV_CACHE, SCHEDULING = "weights", "kv_cache", "scheduling"
SLEEP_TAGS = (WEIGHTS, KV_CACHE, SCHEDULING)


def tags_for_level(level: int) -> set[str]:
    """Level 0 only stops scheduling; levels 1 and 2 also free the KV cache and take the
    weights away (offloaded at 1, discarded at 2)."""
    return {SCHEDULING} if level == 0 else {SCHEDULING, KV_CACHE, WEIGHTS}


@dataclass
class SleepState:
    level: int = 0
    asleep: set[str] = field(default_factory=set)
    # Set when level-2 weights were woken as zeros: no step runs until weights are loaded.
    weights_missing: bool = False
    resume_on_wake: bool = True  # False if the engine was already paused before sleeping
    # A sleep waiting for its pause to complete; weights must not start changing meanwhile.
    pending: bool = False

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def wake_order(self, tags: list[str] | None) -> list[str]:
        """The asleep tags to wake, weights and KV before scheduling. Waking scheduling
        while weights or KV stay asleep is refused before anything changes; the call that
        leaves neither asleep wakes scheduling too."""
        wanted = set(self.asleep if tags is None else tags) & self.asleep
        memory = {WEIGHTS, KV_CACHE}
        if wanted & memory and not (self.asleep - wanted) & memory:
            # vLLM has no scheduling tag: its clients (OpenRLHF, verl) wake weights and KV,
            # often one per call, and then expect generation. Memory back means running.
            wanted |= self.asleep & {SCHEDULING}
        if SCHEDULING in wanted and (self.asleep - wanted) & {WEIGHTS, KV_CACHE}:
            still = sorted((self.asleep - wanted) & {WEIGHTS, KV_CACHE})
            raise EngineStateError(
                f"tags: cannot wake scheduling while {', '.join(still)} still sleep(s); "
                f"wake them first or in the same call"
            )
        return [tag for tag in SLEEP_TAGS if tag in wanted]


class SleepManager:
    """Sleeps and wakes the engine core: a sleep is a pause (its mode) that, once complete,
    frees what its level frees; `wake_up` brings parts back by tag.

    Invariants: nothing is freed before the pause completes (`pending` meanwhile, and no
    weight call may start then); a sleep never starts while a weight round is open (its
    commit would write into freed weights); a resume while asleep takes effect only when
    scheduling wakes, and a sleep entered while paused wakes still paused; levels only
    deepen until every part is awake again."""

    def __init__(
        self,
        enabled: bool,
        state: SleepState,
        pauses: PauseManager,
        runner: ModelRunner,
        weight_sync: WeightSync,
    ) -> None:
        self.enabled = enabled
        self.state = state
        self.pauses = pauses
        self.runner = runner
        self.weight_sync = weight_sync

    def sleep(self, level: int, mode: str = "abort") -> list[EngineCoreOutput]:
        """Pause with `mode`; once complete, `finish_sleep(level)` frees what the level
        frees. Returns the outputs of requests aborted by the pause."""
        if not self.enabled:
            raise EngineStateError(
                "sleep mode is not enabled: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode)"
            )
        self.weight_sync.refuse_during_round(verb_name(Sleep))
        if not self.state.is_sleeping:
            self.state.resume_on_wake = not self.pauses.is_paused()
        outputs = self.pauses.pause(mode, clear_cache=level >= 1)
        self.state.pending = True
        return outputs

    @handles(Sleep)
    def on_sleep(self, args: Sleep, out: Outputs) -> Deferred:
        out.extend(self.sleep(args.level, args.mode))
        return Deferred(lambda: self.finish_sleep(args.level))

    def finish_sleep(self, level: int) -> None:
        self.state.pending = False
        self.pauses.finish_pause(clear_cache=level >= 1)
        # Frozen requests were preempted by the clear; only PAUSED_ALL keeps them waiting.
        self.pauses.pause_all()
        if level >= 1:
            self.runner.free_kv_cache()
            self.runner.weights_changed()  # packed copies go to sleep with the weights
            self.runner.offload_weights(level == 1)  # level 2 discards them
            self.weight_sync.release_buffers()
            self.runner.release_cached_memory()
        self.state.level = max(self.state.level, level)
        self.state.asleep |= tags_for_level(level)

    @handles(IsSleeping)
    def on_is_sleeping(self, args: IsSleeping, out: Outputs) -> bool:
        return self.state.is_sleeping

    @handles(WakeUp)
    def on_wake_up(self, args: WakeUp, out: Outputs) -> dict[str, object]:
        state = self.state
        order = state.wake_order(args.tags)
        for tag in order:
            if tag == WEIGHTS:
                self.runner.weights_changed()
                if not self.runner.restore_weights():
                    state.weights_missing = True
            elif tag == KV_CACHE:
                self.runner.restore_kv_cache()
            state.asleep.discard(tag)
            if tag == SCHEDULING and state.resume_on_wake:
                self.resume()
        if not state.asleep:
            state.level = 0
        return {"is_sleeping": state.is_sleeping, "tags_woken": order}

    @handles(Resume)
    def on_resume(self, args: Resume, out: Outputs) -> None:
        self.resume()

    def resume(self) -> None:
        """Unpause now, or when scheduling wakes if the engine sleeps."""
        if self.state.is_sleeping:
            self.state.resume_on_wake = True
            return
        self.pauses.unpause()
