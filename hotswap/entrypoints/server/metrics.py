"""`/metrics` in Prometheus text format.

Engine gauges are read from one `get_stats()` snapshot per scrape (so a scrape sees one
consistent state); token and request counters are kept by the front-end as outputs pass;
pause/resume latencies are histograms observed by the control routes. The same state is
also exported under vLLM's metric names (metrics_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hotswap.engine import verbs
from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.server.metrics_vllm import WeightOperationMetrics, snapshot_families

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# (metric name, stats key, help)
_GAUGES = (
    ("hotswap:num_requests_running", "num_running", "Requests in the running queue."),
    ("hotswap:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("hotswap:kv_cache_usage_perc", "kv_usage", "Fraction of KV-cache blocks in use (0-1)."),
    (
        "hotswap:prefix_cache_hit_rate",
        "prefix_cache_hit_rate",
        "Fraction of looked-up prompt tokens found in the prefix cache.",
    ),
    ("hotswap:is_paused", "is_paused", "1 while generation is paused."),
    ("hotswap:is_sleeping", "is_sleeping", "1 while the engine sleeps."),
    ("hotswap:sleep_level", "sleep_level", "Sleep level (0 when awake)."),
    (
        "hotswap:weights_missing",
        "weights_missing",
        "1 after a level-2 sleep until weights are sent or reloaded (nothing runs).",
    ),
    ("hotswap:weight_version", "weight_version", "Integer weight version (+1 per update)."),
    (
        "hotswap:weight_round_open",
        "weight_round_open",
        "1 while a weight-update round is open (no step runs).",
    ),
)
_COUNTERS = (
    ("hotswap:prompt_tokens", "prompt_tokens", "Prompt tokens submitted."),
    ("hotswap:generation_tokens", "generation_tokens", "Tokens generated."),
    ("hotswap:num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks."),
    # data-parallel routing (engine/dp_router.py; 0 with one engine core)
    ("hotswap:dp_session_hits", "dp_session_hits", "Requests sent to their session's rank."),
    (
        "hotswap:dp_session_moves",
        "dp_session_moves",
        "Requests whose session's rank was overloaded: spilled, the session moved.",
    ),
    ("hotswap:dp_prefix_hits", "dp_prefix_hits", "Requests sent to the rank caching their prefix."),
    # return_bf16_logprobs (engine/scoring.py): the FP8-bf16 gap; mean |gap| = the ratio
    # of the first two's rates
    ("hotswap:bf16_scored_tokens", "bf16_scored_tokens",
     "Sampled tokens scored with the bf16 weights (return_bf16_logprobs)."),
    ("hotswap:bf16_logprob_abs_diff", "bf16_logprob_abs_diff_sum",
     "Sum over scored tokens of |sampled logprob - bf16 logprob|."),
    ("hotswap:bf16_tis_clipped_tokens", "bf16_tis_clipped_tokens",
     "Scored tokens whose importance weight exp(bf16 - sampled logprob) exceeds 2."),
)  # fmt: skip
# One series per data-parallel rank: (family, name, help, the stats key of its list).
_PER_RANK = (
    (CounterMetricFamily, "hotswap:dp_routed_requests",
     "Requests sent to each data-parallel rank.", "dp_routed"),
    (GaugeMetricFamily, "hotswap:dp_prefix_cache_hit_rate",
     "Each data-parallel rank's prefix-cache hit rate.", "rank_prefix_cache_hit_rate"),
)  # fmt: skip


class _EngineSnapshot(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.stats, ["model_name"]
        for name, key, doc in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family
        state = GaugeMetricFamily(
            "hotswap:pause_state", "1 for the scheduler's pause state.", labels=[*labels, "state"]
        )
        for name in ("UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"):
            state.add_metric([self.model_name, name], float(stats.get("pause_state") == name))
        yield state
        label = GaugeMetricFamily(
            "hotswap:weight_label", "1 for the current weight label.", labels=[*labels, "label"]
        )
        label.add_metric([self.model_name, str(stats.get("weight_label", ""))], 1.0)
        yield label
        for name, key, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family
        finished = CounterMetricFamily(
            "hotswap:request_success", "Finished requests.", labels=[*labels, "finished_reason"]
        )
        for reason, count in sorted(stats.get("finished_requests", {}).items()):
            finished.add_metric([self.model_name, reason], float(count))
        yield finished
        for kind, name, text, key in _PER_RANK:
            family = kind(name, text, labels=[*labels, "rank"])
            for rank, value in enumerate(stats.get(key, [])):
                family.add_metric([self.model_name, str(rank)], float(value))
            yield family
        yield from snapshot_families(stats, self.model_name)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.snapshot = _EngineSnapshot(model_name)
        self.registry.register(self.snapshot)
        self.model_name = model_name
        self.pause_latency = Histogram(
            "hotswap:pause_latency_seconds",
            "Time from a pause call to its completion.",
            ["model_name", "mode"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resume_latency = Histogram(
            "hotswap:resume_latency_seconds",
            "Time to answer a resume call.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.weight_operations = WeightOperationMetrics(self.registry)

    def observe_verb(self, args: verbs.Args, seconds: float, ok: bool = True) -> None:
        """A control verb answered over HTTP after `seconds` (`ok`: not refused)."""
        self.weight_operations.observe(args, ok)
        if not ok:
            return
        if isinstance(args, verbs.Pause):
            self.observe_pause(args.mode, seconds)
        elif isinstance(args, verbs.Resume):
            self.observe_resume(seconds)

    def observe_pause(self, mode: str, seconds: float) -> None:
        self.pause_latency.labels(self.model_name, mode).observe(seconds)

    def observe_resume(self, seconds: float) -> None:
        self.resume_latency.labels(self.model_name).observe(seconds)

    async def render(self, engine: AsyncLLM) -> bytes:
        stats = await engine.get_stats()
        stats["is_paused"] = stats.get("pause_state") != "UNPAUSED"
        stats.update(engine.front_end_stats())
        self.snapshot.stats = stats
        return generate_latest(self.registry)
