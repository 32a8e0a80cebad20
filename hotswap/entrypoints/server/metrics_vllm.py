"""The `vllm:*` metric families RL dashboards scrape, beside hotswap's own: scheduler
gauges and token counters under vLLM's names, the engine sleep state, and the weight
operations of vLLM's RL routes (generation gauge, update counter and duration, operation
outcomes), each with vLLM's `engine` label (hotswap reports the merged engine as "0")."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hotswap.engine import verbs

ENGINE = "0"
DURATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)
# verb -> vLLM's operation name
OPERATIONS: dict[type[verbs.Args], str] = {
    verbs.InitWeightTransfer: "init",
    verbs.StartWeightUpdate: "start",
    verbs.UpdateWeights: "update",
    verbs.FinishWeightUpdate: "finish",
    verbs.UpdateWeightVersion: "set_version",
}
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # level 0 / 1 / 2


def snapshot_families(stats: dict[str, Any], model_name: str) -> Iterator[Metric]:
    """vLLM's gauges and counters from one engine stats snapshot."""
    labels, values = ["model_name", "engine"], [model_name, ENGINE]
    for name, key, doc in (
        ("vllm:num_requests_running", "num_running", "Requests in model execution batches."),
        ("vllm:num_requests_waiting", "num_waiting", "Requests waiting to be processed."),
        ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage (1 = full)."),
    ):
        yield _one(GaugeMetricFamily(name, doc, labels=labels), values, stats.get(key, 0))
    for name, key, doc in (
        ("vllm:prompt_tokens", "prompt_tokens", "Prefill tokens processed."),
        ("vllm:generation_tokens", "generation_tokens", "Generation tokens processed."),
        ("vllm:num_preemptions", "num_preemptions", "Cumulative preemptions."),
    ):
        yield _one(CounterMetricFamily(name, doc, labels=labels), values, stats.get(key, 0))
    finished = CounterMetricFamily(
        "vllm:request_success", "Finished requests.", labels=[*labels, "finished_reason"]
    )
    for reason, count in sorted(stats.get("finished_requests", {}).items()):
        finished.add_metric([*values, reason], float(count))
    yield finished
    yield _sleep_state(stats, labels, values)
    rl = ["engine"]
    yield _one(GaugeMetricFamily("vllm:rl_weight_gen", "Committed weight generation (+1 per "
               "commit).", labels=rl), [ENGINE], stats.get("weight_version", 0))  # fmt: skip
    yield _one(GaugeMetricFamily("vllm:rl_weight_update_active", "1 while a weight update "
               "is open.", labels=rl), [ENGINE], stats.get("weight_round_open", False))  # fmt: skip


def _sleep_state(stats: dict[str, Any], labels: list[str], values: list[str]) -> Metric:
    family = GaugeMetricFamily(
        "vllm:engine_sleep_state",
        "Engine sleep state: awake = 1 when awake; weights_offloaded = 1 at sleep level 1; "
        "discard_all = 1 at level 2.",
        labels=[*labels, "sleep_state"],
    )
    level = int(stats.get("sleep_level", 0)) if stats.get("is_sleeping") else None
    for index, state in enumerate(SLEEP_STATES):
        on = level is None if index == 0 else level == index
        family.add_metric([*values, state], float(on))
    return family


def _one(family: Any, values: list[str], value: object) -> Metric:
    family.add_metric(values, float(value))  # type: ignore[arg-type]
    return family


class WeightOperationMetrics:
    """Outcomes and durations of the weight operations called over HTTP."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.operations = Counter(
            "vllm:rl_weight_update_operations", "Weight operations by outcome.",
            ["operation", "status"], registry=registry,
        )  # fmt: skip
        self.updates = Counter(
            "vllm:rl_weight_update", "Committed weight updates.", ["engine"], registry=registry
        )
        self.duration = Histogram(
            "vllm:rl_weight_update_duration_seconds", "From start_weight_update to its commit.",
            ["engine"], buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.updates.labels(ENGINE)  # present from the start, at 0
        self.duration.labels(ENGINE)
        self._started: float | None = None

    def observe(self, args: verbs.Args, ok: bool) -> None:
        operation = OPERATIONS.get(type(args))
        if operation is None:
            return
        self.operations.labels(operation, "success" if ok else "error").inc()
        if not ok:
            return
        if operation == "start":
            self._started = time.perf_counter()
        elif operation == "finish" and not args.abort:  # type: ignore[attr-defined]
            self.updates.labels(ENGINE).inc()
            if self._started is not None:
                self.duration.labels(ENGINE).observe(time.perf_counter() - self._started)
        if operation == "finish":
            self._started = None
