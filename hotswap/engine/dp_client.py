"""Data parallel (DESIGN §2): N engine cores, each in its own child process with its own
model copy and KV cache, behind one front-end.

- A new request goes to the rank with the fewest unfinished requests; its aborts follow it.
- Every control call goes to every rank and is answered once all have answered, with the
  results merged (counts summed; otherwise rank 0's answer, or the first rank's error).
  Outputs a rank produced before its answer are delivered before the merged answer, so
  pause keeps its contract across ranks.
- For a broadcast weight transfer the ranks are workers `rank_offset + i`: the trainer's
  group is 1 + N, and every rank receives the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import defaultdict

from hotswap.config import EngineArgs
from hotswap.engine.core_client import EngineCoreClient, MPEngineClient, OutputHandler
from hotswap.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
    UtilityResult,
)

# Summed across ranks (other numbers: see _merge_stats).
_SUMMED_RESULTS = frozenset({"get_world_size", "reset_prefix_cache"})
_MAX_STATS = frozenset({"weight_version", "sleep_level", "step_ms_p50", "step_ms_p99"})


def rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """One rank's engine: its own GPU (cuda:base+rank), a share of the CPU threads."""
    device = args.device
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        device = f"cuda:{base + rank}"
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // args.data_parallel_size)
    return dataclasses.replace(args, device=device, num_threads=threads, data_parallel_size=1)


class DPEngineClient(EngineCoreClient):
    def __init__(self, engine_args: EngineArgs) -> None:
        self.ranks: list[MPEngineClient] = []
        try:
            for rank in range(engine_args.data_parallel_size):
                self.ranks.append(MPEngineClient(rank_args(engine_args, rank)))
        except BaseException:
            self.shutdown()
            raise
        self.lock = threading.Lock()  # every rank's receiver thread calls in
        self.owner: dict[str, int] = {}  # unfinished request id -> rank
        self.load = [0] * len(self.ranks)
        self.routed = [0] * len(self.ranks)  # requests sent to each rank, ever
        self.answers: dict[int, list[UtilityResult | None]] = {}
        self.methods: dict[int, str] = {}
        self.on_outputs: OutputHandler | None = None

    def start(self, on_outputs: OutputHandler) -> None:
        self.on_outputs = on_outputs
        for index, rank in enumerate(self.ranks):
            rank.start(functools.partial(self._from_rank, index))

    def add_request(self, request: EngineCoreRequest) -> None:
        with self.lock:
            rank = min(range(len(self.ranks)), key=lambda i: self.load[i])
            self.owner[request.request_id] = rank
            self.load[rank] += 1
            self.routed[rank] += 1
        self.ranks[rank].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = defaultdict(list)
        with self.lock:
            for request_id in request_ids:
                if request_id in self.owner:
                    by_rank[self.owner[request_id]].append(request_id)
        for rank, ids in by_rank.items():
            self.ranks[rank].abort_requests(ids)

    def call_utility(self, call: UtilityCall) -> None:
        with self.lock:
            self.answers[call.call_id] = [None] * len(self.ranks)
            self.methods[call.call_id] = call.method
        for index, rank in enumerate(self.ranks):
            rank.call_utility(UtilityCall(call.call_id, call.method, _args_for(call, index)))

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()

    def _from_rank(self, index: int, batch: EngineCoreOutputs) -> None:
        assert self.on_outputs is not None
        if batch.engine_error is not None:
            self.on_outputs(EngineCoreOutputs(engine_error=f"rank {index}: {batch.engine_error}"))
            return
        with self.lock:  # held while handing over, so batches keep their order
            for output in batch.outputs:
                if output.finish_reason is not None and output.request_id in self.owner:
                    self.load[self.owner.pop(output.request_id)] -= 1
            merged = []
            for result in batch.results:
                slots = self.answers.get(result.call_id)
                if slots is None:
                    continue
                slots[index] = result
                if all(slot is not None for slot in slots):
                    del self.answers[result.call_id]
                    merged.append(_merge(self.methods.pop(result.call_id), slots))
            if batch.outputs or merged:
                self.on_outputs(EngineCoreOutputs(batch.outputs, merged))


def _args_for(call: UtilityCall, rank: int) -> list:
    """Rank `rank` joins a broadcast group as worker rank_offset + rank."""
    if call.method == "init_weight_transfer_engine" and call.args:
        info = call.args[0]
        if isinstance(info, dict) and isinstance(info.get("rank_offset"), int):
            return [{**info, "rank_offset": info["rank_offset"] + rank}]
    return list(call.args)


def _merge(method: str, results: list[UtilityResult]) -> UtilityResult:
    for rank, result in enumerate(results):
        if result.error is not None:
            return UtilityResult(result.call_id, error=f"rank {rank}: {result.error}",
                                 error_type=result.error_type)  # fmt: skip
    first = results[0]
    values = [r.result for r in results]
    if method in _SUMMED_RESULTS:
        return UtilityResult(first.call_id, result=sum(values))
    if method == "get_stats":
        return UtilityResult(first.call_id, result=_merge_stats(values))
    if method == "get_weight_info" and len({v.get("digest") for v in values}) > 1:
        # Ranks must hold the same weights; say so rather than report rank 0's digest.
        info = {**values[0], "digest": None, "rank_digests": [v.get("digest") for v in values]}
        return UtilityResult(first.call_id, result=info)
    return first


def _merge_stats(stats: list[dict]) -> dict:
    merged = dict(stats[0])
    for key, value in stats[0].items():
        column = [s.get(key, value) for s in stats]
        if isinstance(value, bool):
            merged[key] = any(column)
        elif key in _MAX_STATS:
            merged[key] = max(column)
        elif isinstance(value, int):
            merged[key] = sum(column)
        elif isinstance(value, float):
            merged[key] = sum(column) / len(column)
    merged["data_parallel_size"] = len(stats)
    return merged
