"""The engine core's `get_stats` answer: queues, KV cache, pause and sleep state, weights,
compiled decode and step times."""

from __future__ import annotations

import statistics
from collections import deque

from hotswap.engine.core_outputs import WeightVersion
from hotswap.engine.handlers import Outputs, handles
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.scoring import Bf16Gap
from hotswap.engine.sleep import SleepState
from hotswap.engine.verbs import GetStats
from hotswap.execution.runner import ModelRunner
from hotswap.weights.sync import WeightSync

STEP_TIMES_KEPT = 256


class EngineStats:
    """Reads the core's state into one flat dict; the recent step times are its own.

    Invariants: reading changes nothing (the stats are answered between steps, any number
    of times); only non-empty steps are timed, so an idle engine does not drag the
    percentiles down; a fixed number of recent steps is kept."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sleep_state: SleepState,
        weight_sync: WeightSync,
        versions: WeightVersion,
        bf16_gap: Bf16Gap,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sleep_state = sleep_state
        self.weight_sync = weight_sync
        self.versions = versions
        self.bf16_gap = bf16_gap  # return_bf16_logprobs' FP8-bf16 gap (engine/scoring.py)
        self.step_seconds: deque[float] = deque(maxlen=STEP_TIMES_KEPT)  # non-empty steps

    def record_step(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    @handles(GetStats)
    def on_get_stats(self, args: GetStats, out: Outputs) -> dict[str, int | float | str]:
        return self.get_stats()

    def get_stats(self) -> dict[str, int | float | str]:
        sched = self.scheduler
        return {
            "num_requests": len(sched.requests),
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_free_blocks": sched.kv.num_free_blocks,
            "num_blocks": sched.kv.pool.num_blocks,
            "kv_usage": sched.kv.usage,
            "prefix_cache_hit_rate": sched.kv.hit_rate,
            "prefix_cache_queries": sched.kv.num_queries,  # prompt tokens looked up
            "prefix_cache_hits": sched.kv.num_hits,  # of which found
            "num_retained_blocks": len(sched.kv.pool.retained),  # kept for a next turn
            "num_preemptions": sched.num_preemptions,
            "pause_state": sched.pause_state.name,
            "weight_version": self.versions.version,
            "weight_label": self.versions.label,
            "is_sleeping": self.sleep_state.is_sleeping,
            "sleep_level": self.sleep_state.level,
            "weights_missing": self.sleep_state.weights_missing,
            "weight_round_open": self.weight_sync.round_open,
            # How a commit switches weights: "swap" (double buffer) or "copy".
            "weight_switch": "swap" if self.weight_sync.shadow is not None else "copy",
            **self.bf16_gap.stats(),
            **self._compiled_stats(),
            **self._step_time_stats(),
        }

    def _compiled_stats(self) -> dict[str, int | bool]:
        """Decode steps through the compiled graphs, and those that ran eagerly instead
        (a shape the graphs were not compiled for)."""
        compiled = self.runner.compiled
        return {
            "compiled_decode": compiled is not None,
            "compiled_decode_steps": compiled.compiled_steps if compiled else 0,
            "eager_decode_steps": compiled.eager_steps if compiled else 0,
        }

    def _step_time_stats(self) -> dict[str, float]:
        steps = sorted(self.step_seconds) or [0.0]
        return {
            "step_ms_p50": 1000 * statistics.median(steps),
            "step_ms_p99": 1000 * steps[min(len(steps) - 1, round(0.99 * (len(steps) - 1)))],
        }
