"""EngineCore: owns the scheduler and the model runner; one `step()` is one batch."""

from __future__ import annotations

from collections.abc import Iterable

from hotswap.config import EngineConfig
from hotswap.engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobsMsg
from hotswap.engine.request import Request, RequestStatus
from hotswap.engine.scheduler import PauseState, Scheduler
from hotswap.model.runner import ModelRunner, RunnerOutput


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.runner = ModelRunner(config, progress)
        _check_kv_capacity(self.runner.num_blocks, config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks)
        self.vocab_size = config.model.vocab_size

    # -- inputs ---------------------------------------------------------------------------
    def validate_request(self, req: EngineCoreRequest) -> None:
        """Raise ValueError naming the problem; changes nothing."""
        ids = req.prompt_token_ids
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        bad = next((t for t in ids if not _is_token_id(t, self.vocab_size)), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids: token id {bad!r} is outside the vocabulary "
                f"(integers 0..{self.vocab_size - 1})"
            )
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt: {len(ids)} tokens is too long for max_model_len={limit} "
                f"(at least one token must fit after it)"
            )
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already in use")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate_request(req)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [_finished_output(r) for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        return self.scheduler.kv.reset_prefix_cache()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._check_not_stuck()
            return []
        result = self.runner.execute(plan)
        changed = self.scheduler.update_from_output(plan, result.sampled)
        return [_step_output(r, result) for r in changed]

    def _check_not_stuck(self) -> None:
        sched = self.scheduler
        if sched.pause_state == PauseState.UNPAUSED and sched.waiting and not sched.running:
            # KV capacity >= max_model_len guarantees an idle engine can always admit.
            raise RuntimeError(
                f"scheduler: {sched.num_waiting} waiting requests but none can be admitted "
                f"with {sched.kv.num_free_blocks} free blocks"
            )


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _check_kv_capacity(num_blocks: int, config: EngineConfig) -> None:
    capacity = num_blocks * config.cache.block_size
    max_len = config.scheduler.max_model_len
    if capacity < max_len:
        # Name the knob the user sized the cache with (blocks, or the memory budget).
        knob = "num_kv_blocks" if config.cache.num_blocks is not None else "kv_cache_memory_bytes"
        raise ValueError(
            f"{knob}: the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{config.cache.block_size}), fewer than max_model_len={max_len}; give it more "
            f"memory or lower max_model_len"
        )


def _step_output(request: Request, result: RunnerOutput) -> EngineCoreOutput:
    logprobs = result.logprobs.get(request.request_id)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[request.output_token_ids[-1]],
        new_logprobs=None
        if logprobs is None
        else [
            TokenLogprobsMsg(
                logprobs.token_logprob, logprobs.token_rank, logprobs.top_ids, logprobs.top_logprobs
            )
        ],
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def _finished_output(request: Request) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )
