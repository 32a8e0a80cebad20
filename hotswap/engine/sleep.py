"""Sleep levels and wake tags (DESIGN §3, spec "Sleep"): what each level puts to sleep and
the order in which parts may wake."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotswap.engine.errors import EngineStateError

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
