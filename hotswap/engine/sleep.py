"""Sleep levels and wake tags (DESIGN §3, spec "Sleep"): what each level puts to sleep and
the order in which parts may wake."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotswap.engine.errors import EngineStateError

SLEEP_LEVELS = (0, 1, 2)
WEIGHTS, KV_CACHE, SCHEDULING = "weights", "kv_cache", "scheduling"
SLEEP_TAGS = (WEIGHTS, KV_CACHE, SCHEDULING)


def check_sleep_level(level: object) -> int:
    if not isinstance(level, int) or isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level: must be 0, 1 or 2, got {level!r}")
    return level


def check_wake_tags(tags: object) -> list[str] | None:
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags: must be a list of strings, got {tags!r}")
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"tags: unknown {unknown}; choose from {', '.join(SLEEP_TAGS)}")
    return tags


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
