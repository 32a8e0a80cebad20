"""Data parallel (docs/design.md §2): N engine cores, each in its own child process (or Ray actor,
hotswap.ray.dp) with its own model copy and KV cache, behind one front-end.

- A new request goes to the rank `--dp-routing` picks (dp_router.py: its session's, the one
  caching its prefix, or the one with the fewest unfinished requests); its aborts follow it.
- Every control call goes to every rank and is answered once all have answered, with the
  results merged as its verb declares (verbs.Merge), or the first rank's error.
  Outputs a rank produced before its answer are delivered before the merged answer, so
  pause keeps its contract across ranks.
- For a broadcast weight transfer the ranks are workers `rank_offset + i`: the trainer's
  group is 1 + N, and every rank receives the same bytes. With m2n every tensor-parallel
  rank of every core receives its own slices: core i's rank r is engine rank i * tp + r.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import defaultdict

from hotswap.engine import verbs
from hotswap.engine.core_client import EngineCoreClient, MPEngineClient, OutputHandler
from hotswap.engine.dp_router import DPRouter
from hotswap.engine.messages import (
    CallError,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
    UtilityResult,
)
from hotswap.engine_args import EngineArgs
from hotswap.weight_transfer.backends import get_backend
from hotswap.weight_transfer.config import WeightTransferConfig
from hotswap.weight_transfer.engine import shift_rank_offset

# cache-aware routing: block hashes remembered per rank when the KV cache is sized by memory
# (its block count is known only inside the rank)
PREFIX_BLOCKS = 1 << 16
_MAX_STATS = frozenset({"weight_version", "sleep_level", "step_ms_p50", "step_ms_p99"})


def rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """One rank's engine: its own GPUs (cuda:base + rank x tensor_parallel_size, its
    tensor-parallel ranks on the next ones), a share of the CPU threads."""
    device = args.device
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        device = f"cuda:{base + rank * args.tensor_parallel_size}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or max(1, (cpus or 1) // args.data_parallel_size)
    return dataclasses.replace(
        args, device=device, num_threads=threads, data_parallel_size=1, data_parallel_rank=rank
    )


class RankLauncher:
    """Starts the data-parallel ranks: by default each in a child process (an
    `MPEngineClient`); hotswap.ray.dp starts them as Ray actors. `shutdown` runs after
    every rank's, to release what the launcher holds."""

    def start_rank(self, engine_args: EngineArgs, rank: int) -> EngineCoreClient:
        return MPEngineClient(rank_args(engine_args, rank))

    def shutdown(self) -> None:
        pass


class DPEngineClient(EngineCoreClient):
    def __init__(self, engine_args: EngineArgs, launcher: RankLauncher | None = None) -> None:
        self.launcher = launcher if launcher is not None else RankLauncher()
        self.ranks: list[EngineCoreClient] = []
        try:
            for rank in range(engine_args.data_parallel_size):
                self.ranks.append(self.launcher.start_rank(engine_args, rank))
        except BaseException:
            self.shutdown()
            raise
        self.lock = threading.Lock()  # every rank's receiver thread calls in
        self.owner: dict[str, int] = {}  # request id -> the rank it was last sent to
        # Unfinished requests per rank. A reused id may briefly be on two ranks (the old
        # one still finishing its abort), so ranks count their own.
        self.active: list[set[str]] = [set() for _ in self.ranks]
        self.router = DPRouter(
            engine_args.dp_routing,
            len(self.ranks),
            engine_args.max_num_seqs,
            engine_args.block_size,
            engine_args.num_kv_blocks or PREFIX_BLOCKS,
        )
        self.answers: dict[int, list[UtilityResult | None]] = {}
        self.methods: dict[int, type[verbs.Args]] = {}  # call id -> its verb
        self.on_outputs: OutputHandler | None = None
        # Whether core i joins a broadcast group as worker rank_offset + i (m2n's ranks
        # place themselves by their core's data_parallel_rank instead).
        config = WeightTransferConfig.parse(engine_args.weight_transfer_config)
        self.shifts = config is None or not get_backend(config.backend).every_rank_receives
        self.dead = False  # a rank died: the front end has failed everything already

    @property
    def routed(self) -> list[int]:
        """Requests sent to each rank, ever."""
        return self.router.stats.routed

    def routing_stats(self) -> dict[str, object]:
        with self.lock:
            return self.router.stats.as_dict()

    def start(self, on_outputs: OutputHandler) -> None:
        self.on_outputs = on_outputs
        for index, rank in enumerate(self.ranks):
            rank.start(functools.partial(self._from_rank, index))

    def add_request(self, request: EngineCoreRequest) -> None:
        with self.lock:
            loads = [len(active) for active in self.active]
            rank = self.router.choose(
                loads, request.session_id, request.data_parallel_rank, request.prompt_token_ids
            )
            self.owner[request.request_id] = rank
            self.active[rank].add(request.request_id)
        self.ranks[rank].add_request(request)

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        by_rank: dict[int, list[str]] = defaultdict(list)
        with self.lock:
            for request_id in request_ids:
                if request_id in self.owner:
                    by_rank[self.owner[request_id]].append(request_id)
        for rank, ids in by_rank.items():
            self.ranks[rank].abort_requests(ids, stopped)

    def call_utility(self, call: UtilityCall) -> None:
        with self.lock:
            self.answers[call.call_id] = [None] * len(self.ranks)
            self.methods[call.call_id] = type(call.args)
        for index, rank in enumerate(self.ranks):
            args = _args_for(call.args, index if self.shifts else 0)
            rank.call_utility(UtilityCall(call.call_id, args))

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()
        self.launcher.shutdown()

    def _from_rank(self, index: int, batch: EngineCoreOutputs) -> None:
        assert self.on_outputs is not None
        if batch.engine_error is not None:
            self._rank_died(index, batch.engine_error)
            return
        with self.lock:  # held while handing over, so batches keep their order
            if self.dead:  # e.g. the survivors' aborts: their streams failed already
                return
            for output in batch.outputs:
                if output.finish_reason is not None:
                    self.active[index].discard(output.request_id)
                    if self.owner.get(output.request_id) == index:
                        del self.owner[output.request_id]
            merged = []
            for result in batch.results:
                slots = self.answers.get(result.call_id)
                if slots is None:
                    continue
                slots[index] = result
                if all(slot is not None for slot in slots):
                    del self.answers[result.call_id]
                    merged.append(_merge_safely(self.methods.pop(result.call_id), slots))
            if batch.outputs or merged:
                self.on_outputs(EngineCoreOutputs(batch.outputs, merged))

    def _rank_died(self, index: int, error: str) -> None:
        """The front-end fails every stream and call; stop the other ranks' work too.
        The death is handed over before the survivors are told to abort, and nothing a
        rank sends after it is: otherwise a survivor's request could end as a plain
        "abort" instead of failing with the dead rank's error."""
        assert self.on_outputs is not None
        with self.lock:
            if self.dead:  # the first rank's death is the one reported
                return
            self.dead = True
            survivors = [(i, list(ids)) for i, ids in enumerate(self.active) if i != index]
            self.active = [set() for _ in self.ranks]
            self.owner.clear()
            self.answers.clear()
            self.on_outputs(EngineCoreOutputs(engine_error=f"rank {index}: {error}"))
        for i, ids in survivors:
            self.ranks[i].abort_requests(ids)


def _args_for(args: verbs.Args, shift: int) -> verbs.Args:
    """A core whose first receiving worker is `shift` past rank_offset joins there."""
    if isinstance(args, verbs.InitWeightTransfer):
        return verbs.InitWeightTransfer(init_info=shift_rank_offset(args.init_info, shift))
    return args


def _merge_safely(verb: type[verbs.Args], results: list[UtilityResult]) -> UtilityResult:
    """A merge that fails answers the call with the error instead of killing the rank's
    receiver thread (which would leave every later call unanswered)."""
    try:
        return _merge(verb, results)
    except Exception as e:  # noqa: BLE001
        message = f"merging the ranks' answers to {verbs.verb_name(verb)} failed: {e}"
        return UtilityResult(results[0].call_id, error=CallError("internal", message))


def _merge(verb: type[verbs.Args], results: list[UtilityResult]) -> UtilityResult:
    """The ranks' answers as one, as the verb declares (`verb.merge`); the first error."""
    for rank, result in enumerate(results):
        if result.error is not None:
            error = result.error
            message = f"rank {rank}: {error.message}"
            return UtilityResult(result.call_id, error=CallError(error.kind, message, error.field))
    first = results[0]
    values = [r.result for r in results]
    merge = verb.merge
    if merge == verbs.Merge.SUM:
        return UtilityResult(first.call_id, result=sum(values))
    if merge == verbs.Merge.ANY:
        return UtilityResult(first.call_id, result=any(values))
    if merge == verbs.Merge.STATS:
        return UtilityResult(first.call_id, result=_merge_stats(values))
    if merge == verbs.Merge.UNION:
        return UtilityResult(first.call_id, result={k: v for d in values for k, v in d.items()})
    if merge == verbs.Merge.PER_RANK:  # each rank answers a list of its own
        return UtilityResult(first.call_id, result=[item for value in values for item in value])
    if merge == verbs.Merge.DIGEST:
        return UtilityResult(first.call_id, result=_merge_digests(values))
    return first


def _merge_digests(values: list[dict]) -> dict:
    """Rank 0's weight info; ranks must hold the same weights, so a digest they disagree
    on is reported per rank (and the digest as null). Per-tensor checksums are keyed by
    rank already: their union."""
    info = dict(values[0])
    if len({v.get("digest") for v in values}) > 1:
        info["digest"] = None
        info["rank_digests"] = [v.get("digest") for v in values]
    if any(isinstance(v.get("checksums"), dict) for v in values):
        info["checksums"] = {k: h for v in values for k, h in (v.get("checksums") or {}).items()}
    return info


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
    # The hit rate of all ranks' lookups together (not a mean of rates), and each rank's:
    # routing shows in them (engine/dp_router.py).
    queries, hits = merged.get("prefix_cache_queries", 0), merged.get("prefix_cache_hits", 0)
    merged["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    merged["rank_prefix_cache_hit_rate"] = [s.get("prefix_cache_hit_rate", 0.0) for s in stats]
    return merged
