"""EngineCore: owns the scheduler and the model runner; one `step()` is one batch.

Control-call arguments arrive validated (verbs.py); the core refuses only what its state
does not allow (EngineStateError) or what only it can check (a checkpoint, a channel)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable

import torch

from hotswap.config import EngineConfig
from hotswap.engine.errors import EngineStateError
from hotswap.engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobsMsg
from hotswap.engine.prompts import check_prompt
from hotswap.engine.request import Request, RequestStatus
from hotswap.engine.scheduler import PauseState, Scheduler
from hotswap.engine.sleep import (
    KV_CACHE,
    SCHEDULING,
    WEIGHTS,
    SleepState,
    tags_for_level,
)
from hotswap.engine.verbs import InlineTensor
from hotswap.engine.weight_sync import WeightApplyError, WeightSync
from hotswap.engine.worker import WorkerExtension, load_extension_class
from hotswap.errors import InvalidArgument
from hotswap.model.runner import ModelRunner, RunnerOutput
from hotswap.model.sampler import TokenLogprobs
from hotswap.structured_output import LazyGrammarCompiler

DEFAULT_WEIGHT_LABEL = "default"


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.runner = ModelRunner(config, progress)
        _check_kv_capacity(self.runner.num_blocks, config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks)
        self.vocab_size = config.model.vocab_size
        self.weight_version = 0  # +1 per committed update
        self.weight_label = DEFAULT_WEIGHT_LABEL
        self.step_seconds: deque[float] = deque(maxlen=256)  # recent non-empty steps
        self.sleep_state = SleepState()
        transfer = config.weight_transfer
        self.round_timeout_s = transfer.round_timeout_s if transfer is not None else 0.0
        self.weight_sync = WeightSync(
            self.runner.model,
            config.weight_transfer,
            torch.device(config.device),
            config.allowed_weight_dirs,
        )
        self._digest: tuple[tuple[int, bool], str] | None = None  # cache key, digest
        self.worker_extension: WorkerExtension | None = None
        self.grammars = LazyGrammarCompiler(config.tokenizer or config.model.path, self.vocab_size)
        if config.worker_extension_cls is not None:
            cls = load_extension_class(config.worker_extension_cls)
            device, rank = torch.device(config.device), config.data_parallel_rank
            self.worker_extension = WorkerExtension(cls, self.runner, device, rank)

    # -- inputs ---------------------------------------------------------------------------
    def validate_request(self, req: EngineCoreRequest) -> None:
        """Raise ValueError naming the problem; changes nothing."""
        check_prompt(req.prompt_token_ids, self.vocab_size, self.config.scheduler.max_model_len)
        if req.request_id in self.scheduler.requests:
            raise InvalidArgument("request_id", f"request_id: {req.request_id!r} is already in use")
        req.sampling_params.check_token_ids(self.vocab_size)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate_request(req)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.cache_salt,
        )
        constraint = req.sampling_params.structured_outputs
        if constraint is not None:
            request.grammar = self.grammars.matcher(constraint, req.eos_token_id)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self._finished_output(r) for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> int:
        """Forget every cached prefix. With `reset_running_requests`, running requests
        also drop their KV and recompute it when next scheduled."""
        if reset_running_requests:
            self.scheduler.drop_running_kv()
        return self.scheduler.kv.reset_prefix_cache()

    def has_work(self) -> bool:
        # Nothing runs while any part sleeps or level-2 weights have not been sent again.
        sleep = self.sleep_state
        if sleep.asleep or sleep.weights_missing or self.round_blocks_steps:
            return False
        return self.scheduler.has_work()

    @property
    def round_blocks_steps(self) -> bool:
        """An open round stops generation unless it is received in flight (beside the
        steps, on the committed weights, switched at `finish` between two steps)."""
        sync = self.weight_sync
        return sync.round_open and not (sync.config is not None and sync.config.in_flight)

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
            "num_preemptions": sched.num_preemptions,
            "pause_state": sched.pause_state.name,
            "weight_version": self.weight_version,
            "weight_label": self.weight_label,
            "is_sleeping": self.sleep_state.is_sleeping,
            "sleep_level": self.sleep_state.level,
            "weights_missing": self.sleep_state.weights_missing,
            "weight_round_open": self.weight_sync.round_open,
            # How a commit switches weights: "swap" (double buffer) or "copy".
            "weight_switch": "swap" if self.weight_sync.shadow is not None else "copy",
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

    # -- pause / resume (DESIGN §3) ------------------------------------------------------
    def pause(self, mode: str, clear_cache: bool = True) -> list[EngineCoreOutput]:
        """Enter the pause state for `mode` (never loosening a stricter one). Returns the
        outputs of requests aborted by `abort` mode; `pause_complete()` tells when the
        caller may return, and `finish_pause()` must run then."""
        outputs = self.abort_requests(list(self.scheduler.requests)) if mode == "abort" else []
        wanted = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        self.scheduler.set_pause_state(max(self.scheduler.pause_state, wanted))
        return outputs

    def pause_complete(self) -> bool:
        """`keep`: at once (the loop only calls this between steps); `abort`/`wait`: when no
        started request remains; a resume that overtook the pause also ends the wait."""
        state = self.scheduler.pause_state
        return state != PauseState.PAUSED_NEW or not self.scheduler.has_started_requests()

    def finish_pause(self, clear_cache: bool) -> None:
        if clear_cache and self.scheduler.pause_state != PauseState.UNPAUSED:
            self.scheduler.drop_running_kv()
            self.reset_prefix_cache()

    def resume(self) -> None:
        if self.sleep_state.is_sleeping:  # takes effect when scheduling wakes
            self.sleep_state.resume_on_wake = True
            return
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def is_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    # -- sleep (spec "Sleep") -------------------------------------------------------------
    def sleep(self, level: int, mode: str = "abort") -> list[EngineCoreOutput]:
        """Pause with `mode`; once complete, `finish_sleep(level)` frees what the level
        frees. Returns the outputs of requests aborted by the pause."""
        if not self.config.enable_sleep_mode:
            raise EngineStateError(
                "sleep mode is not enabled: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode)"
            )
        self._refuse_during_weight_round("sleep")
        if not self.sleep_state.is_sleeping:
            self.sleep_state.resume_on_wake = not self.is_paused()
        outputs = self.pause(mode, clear_cache=level >= 1)
        self.sleep_state.pending = True
        return outputs

    def finish_sleep(self, level: int) -> None:
        self.sleep_state.pending = False
        self.finish_pause(clear_cache=level >= 1)
        # Frozen requests were preempted by the clear; only PAUSED_ALL keeps them waiting.
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL)
        if level >= 1:
            self.runner.free_kv_cache()
            self.runner.weights_changed()  # packed copies go to sleep with the weights
            if level == 2:
                self.runner.residency.discard()
            else:
                self.runner.residency.offload()
            self.weight_sync.release_buffers()
            self.runner.release_cached_memory()
        state = self.sleep_state
        state.level = max(state.level, level)
        state.asleep |= tags_for_level(level)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, object]:
        state = self.sleep_state
        order = state.wake_order(tags)
        for tag in order:
            if tag == WEIGHTS:
                self.runner.weights_changed()
                if not self.runner.residency.restore():
                    state.weights_missing = True
            elif tag == KV_CACHE:
                self.runner.restore_kv_cache()
            state.asleep.discard(tag)
            if tag == SCHEDULING and state.resume_on_wake:
                self.resume()
        if not state.asleep:
            state.level = 0
        return {"is_sleeping": state.is_sleeping, "tags_woken": order}

    def load_weights_from_disk(
        self, model_dir: str, label: str | None = None
    ) -> list[EngineCoreOutput]:
        """Reload every weight from a safetensors directory (all or nothing) and commit a
        new version; returns requests aborted by `max_weight_lag`. The loop runs this
        between steps, so no step sees a half-loaded model."""
        self._refuse_while_weights_sleep("update_weights_from_disk")
        self._refuse_during_weight_round("update_weights_from_disk")
        try:
            self.weight_sync.reload_from_disk(model_dir)
        except WeightApplyError:
            self.sleep_state.weights_missing = True
            raise
        self.sleep_state.weights_missing = False
        return self.update_weight_version(label or model_dir)

    def load_weights_inline(
        self, tensors: list[InlineTensor], label: str | None = None
    ) -> list[EngineCoreOutput]:
        """Load tensors sent by value (verbs.InlineTensor; only those change) in one
        validated, all-or-nothing round between steps, as a disk reload, and commit a new
        version labelled `label` (default: the current label); returns requests aborted by
        `max_weight_lag`."""
        self._refuse_while_weights_sleep("load_weights_inline")
        self._refuse_during_weight_round("load_weights_inline")
        try:
            staged = self.weight_sync.load_inline(tensors)
        except WeightApplyError:
            self.sleep_state.weights_missing = True
            raise
        if self.sleep_state.weights_missing and self.weight_sync.covers_model(staged, True):
            self.sleep_state.weights_missing = False
        return self.update_weight_version(label or self.weight_label)

    # -- weight transfer (DESIGN §4) --------------------------------------------------------
    def leave_weight_transfer(self) -> bool:
        """Leave the trainer's channel; True if there was one. Never mid-round."""
        self._refuse_during_weight_round("leave_weight_transfer")
        had = self.weight_sync.transfer is not None
        self.weight_sync.drop_transfer()
        return had

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._refuse_while_weights_sleep("start_weight_update")
        self.weight_sync.start(is_checkpoint_format)

    def finish_weight_update(
        self, label: str | None = None, abort: bool = False, kv_policy: str | None = None
    ) -> list[EngineCoreOutput]:
        """Apply the round and commit version + 1 (`label`, or the current label). Returns
        requests aborted by `max_weight_lag`. Requests running across the switch keep their
        KV (`keep`: later tokens are marked stale) or drop it and recompute it under the
        new weights before their next token (`recompute`)."""
        checkpoint = (
            self.weight_sync.round is not None and self.weight_sync.round.is_checkpoint_format
        )
        try:
            staged = self.weight_sync.finish(abort)
        except WeightApplyError:
            self.sleep_state.weights_missing = True
            raise
        if staged is None:
            return []
        missing = self.sleep_state.weights_missing
        if missing and self.weight_sync.covers_model(staged, checkpoint):
            self.sleep_state.weights_missing = False
        outputs = self.update_weight_version(label or self.weight_label)
        config = self.weight_sync.config
        if (kv_policy or (config.kv_policy if config else "keep")) == "recompute":
            self.scheduler.drop_running_kv()
        return outputs

    def _refuse_while_weights_sleep(self, what: str) -> None:
        if WEIGHTS in self.sleep_state.asleep:
            raise EngineStateError(f"{what}: weights are asleep: wake_up(tags=['weights']) first")
        if self.sleep_state.pending:  # finishing it would take the weights mid-round
            raise EngineStateError(f"{what}: a sleep is in progress; let it finish, then wake_up")

    def _refuse_during_weight_round(self, what: str) -> None:
        if self.weight_sync.round_open:
            raise EngineStateError(
                f"{what}: a weight update round is open; finish or abort it first"
            )

    def weights_digest(self) -> str | None:
        """Digest of the loaded weights (cached per version); None while they sleep."""
        if not self.runner.residency.resident:
            return None
        key = (self.weight_version, self.sleep_state.weights_missing)
        if self._digest is None or self._digest[0] != key:
            self._digest = (key, self.runner.weights_digest())
        return self._digest[1]

    # -- weight versions -----------------------------------------------------------------
    def update_weight_version(self, label: str) -> list[EngineCoreOutput]:
        """Commit a new weight version (+1) under `label`; requests that would now lag more
        than their `max_weight_lag` behind their first token's version are aborted."""
        self.weight_version += 1
        self.weight_label = label
        self.scheduler.kv.weight_version = self.weight_version
        # Every path that writes weights commits through here (or says so itself below);
        # derived copies of the weights are remade from the new ones.
        self.runner.weights_changed()
        return self._abort_lagging_requests()

    def get_weight_version(self) -> dict[str, int | str]:
        return {"version": self.weight_version, "label": self.weight_label}

    def collective_rpc(self, method: str, args: list, kwargs: dict) -> object:
        """Call a method of the worker extension (see worker.py)."""
        if self.worker_extension is None:
            raise InvalidArgument("method", "method: collective_rpc needs a worker extension: "
                                  "start the engine with --worker-extension-cls")  # fmt: skip
        try:
            return self.worker_extension.call(method, args, kwargs)
        finally:
            self.runner.weights_changed()  # the method may have written weights

    def set_weight_label(self, label: str) -> dict[str, int | str]:
        """Rename the current weights; the version (and so provenance order) is unchanged."""
        self.weight_label = label
        return self.get_weight_version()

    def weight_checksums(self) -> dict[str, str] | None:
        """vLLM's per-tensor checksums: SHA-256 of each weight's bytes, keyed
        `dp{rank}:pp0:pcp0:tp0:ep0:{name}` (one engine core is one dp rank, unsharded).
        None while the weights sleep."""
        if not self.runner.residency.resident:
            return None
        prefix = f"dp{self.config.data_parallel_rank}:pp0:pcp0:tp0:ep0:"
        return {prefix + name: sha for name, sha in self.runner.weight_checksums().items()}

    def weight_info(self) -> dict[str, object]:
        """{version, label, digest} of the loaded weights (digest None while they sleep)."""
        return {**self.get_weight_version(), "digest": self.weights_digest()}

    def committed_weights(self, digest: bool) -> dict[str, object]:
        """The answer to a finish: {version, label, digest}, taken in the same call as the
        commit so it names exactly that commit. The digest reads every weight (~0.3 s for
        the default model), so it is computed only when asked for; otherwise None."""
        return {**self.get_weight_version(), "digest": self.weights_digest() if digest else None}

    def _abort_lagging_requests(self) -> list[EngineCoreOutput]:
        lagging = {}
        for request in self.scheduler.requests.values():
            limit = request.sampling_params.max_weight_lag
            start = request.start_version
            if limit is not None and start is not None and self.weight_version - start > limit:
                lagging[request.request_id] = (
                    f"max_weight_lag: started on weight version {start}, engine is at "
                    f"{self.weight_version} (limit {limit})"
                )
        finished = self.scheduler.finish_requests(lagging, RequestStatus.FINISHED_ABORTED)
        for request in finished:
            request.stop_reason = lagging[request.request_id]
        return [self._finished_output(r) for r in finished]

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.round_blocks_steps:  # the loop never gets here; direct callers might
            raise EngineStateError(
                "a weight update round is open: no step runs until finish_weight_update"
            )
        if self.sleep_state.weights_missing:
            raise EngineStateError(
                "the weights are incomplete (discarded by sleep level 2, or an update failed "
                "midway): no step runs until a complete round or a reload succeeds"
            )
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._check_not_stuck()
            return []
        result = self.runner.execute(plan)
        for request_id, scored in result.prompt_logprobs.items():
            if (request := self.scheduler.requests.get(request_id)) is not None:
                request.prompt_logprobs.extend(scored)
        changed = self.scheduler.update_from_output(plan, result.sampled)
        outputs = [self._step_output(r, result) for r in changed]
        self.step_seconds.append(time.perf_counter() - start)
        return outputs

    def _step_output(self, request: Request, result: RunnerOutput) -> EngineCoreOutput:
        logprobs = result.logprobs.get(request.request_id)
        out = self._finished_output(request)
        out.new_token_ids = [request.output_token_ids[-1]]
        if logprobs is not None:
            out.new_logprobs = [_logprobs_msg(logprobs)]
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            out.prompt_logprobs = [_logprobs_msg(lp) for lp in request.prompt_logprobs]
            request.prompt_logprobs_sent = True
        return out

    def _finished_output(self, request: Request) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            weight_version=self.weight_version,
            weight_label=self.weight_label,
            stale=request.kv_version != self.weight_version,
        )

    def _check_not_stuck(self) -> None:
        sched = self.scheduler
        if sched.pause_state == PauseState.UNPAUSED and sched.waiting and not sched.running:
            # KV capacity >= max_model_len guarantees an idle engine can always admit.
            raise RuntimeError(
                f"scheduler: {sched.num_waiting} waiting requests but none can be admitted "
                f"with {sched.kv.num_free_blocks} free blocks"
            )


def _logprobs_msg(logprobs: TokenLogprobs) -> TokenLogprobsMsg:
    return TokenLogprobsMsg(
        logprobs.token_logprob, logprobs.token_rank, logprobs.top_ids, logprobs.top_logprobs
    )


def _check_kv_capacity(num_blocks: int, config: EngineConfig) -> None:
    capacity = num_blocks * config.cache.block_size
    max_len = config.scheduler.max_model_len
    if capacity < max_len:
        # Name the knob the user sized the cache with (blocks, or the memory budget).
        knob = "num_kv_blocks" if config.cache.num_blocks is not None else "kv_cache_memory_bytes"
        raise InvalidArgument(
            knob,
            f"{knob}: the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{config.cache.block_size}), fewer than max_model_len={max_len}; give it more "
            f"memory or lower max_model_len",
        )
