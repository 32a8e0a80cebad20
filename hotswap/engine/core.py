"""EngineCore: owns the scheduler and the model runner; one `step()` is one batch.

The core composes one manager per concern and keeps the engine's public methods as thin
delegates to them (the loop's verb handlers, `LLM` and the tests call these):

- `RequestManager` (request_manager.py): admitting, aborting and advancing requests;
- `PauseManager` (pause.py): pause states and when a pause call may return;
- `SleepManager` (sleep.py): sleep levels, what they free, and waking by tag;
- `WeightManager` (weights.py): every write of the weights and the version it commits;
- `EngineStats` (stats.py): the `get_stats` answer and recent step times;
- `WorkerRpc` (rpc.py): `collective_rpc` into the worker extension.

Control-call arguments arrive validated (verbs.py); the core refuses only what its state
does not allow (EngineStateError) or what only it can check (a checkpoint, a channel)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from hotswap.config import EngineConfig
from hotswap.engine.core_outputs import WeightVersion
from hotswap.engine.errors import EngineStateError
from hotswap.engine.messages import EngineCoreOutput, EngineCoreRequest
from hotswap.engine.pause import PauseManager
from hotswap.engine.request_manager import RequestManager
from hotswap.engine.rpc import WorkerRpc
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sleep import SleepManager, SleepState
from hotswap.engine.stats import EngineStats
from hotswap.engine.verbs import InlineTensor
from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner
from hotswap.lora.manager import LoRAManager
from hotswap.weights.manager import WeightManager
from hotswap.weights.sync import WeightSync


class EngineCore:
    """The engine core: runs batches, and the control calls between them.

    Invariants: no step runs while any part sleeps, while the weights are incomplete, or
    while a weight round is open (unless it is received in flight); the loop runs every
    control call between two steps, so no step sees a half-applied change. The state the
    managers share (`sleep_state`, the committed `versions`, the scheduler, the runner,
    `weight_sync`) is created here once and handed to each."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.runner = ModelRunner(config, progress)
        _check_kv_capacity(self.runner.num_blocks, config)
        max_loras = config.lora.max_loras if config.lora is not None else None
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.runner.num_blocks, max_loras
        )
        self.loras = LoRAManager(
            config.lora, self.runner.model, config.model.dtype, config.allowed_weight_dirs
        )
        self.vocab_size = config.model.vocab_size
        self.versions = WeightVersion()  # +1 per committed update
        self.sleep_state = SleepState()
        transfer = config.weight_transfer
        self.round_timeout_s = transfer.round_timeout_s if transfer is not None else 0.0
        self.weight_sync = WeightSync(
            self.runner.model,
            self.runner,
            config.weight_transfer,
            torch.device(config.device),
            config.allowed_weight_dirs,
        )
        runner, scheduler, sleep_state = self.runner, self.scheduler, self.sleep_state
        self.request_manager = RequestManager(config, scheduler, runner, self.versions, self.loras)
        self.rpc = WorkerRpc(config, runner)
        self.pause_manager = PauseManager(
            scheduler, self.request_manager, lambda: sleep_state.weights_missing
        )
        self.sleep_manager = SleepManager(
            config.enable_sleep_mode, sleep_state, self.pause_manager, runner, self.weight_sync
        )
        self.weight_manager = WeightManager(
            config,
            runner,
            scheduler,
            sleep_state,
            self.weight_sync,
            self.request_manager,
            self.versions,
        )
        self.stats = EngineStats(scheduler, runner, sleep_state, self.weight_sync, self.versions)

    # -- the step -------------------------------------------------------------------------
    def has_work(self) -> bool:
        # Nothing runs while any part sleeps or level-2 weights have not been sent again.
        sleep = self.sleep_state
        if sleep.asleep or sleep.weights_missing or self.round_blocks_steps:
            return False
        return self.scheduler.has_work()

    @property
    def round_blocks_steps(self) -> bool:
        return self.weight_manager.round_blocks_steps

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
            self.request_manager.check_not_stuck()
            return []
        outputs = self.request_manager.run(plan)
        self.stats.record_step(time.perf_counter() - start)
        return outputs

    # -- requests (RequestManager) --------------------------------------------------------
    def validate_request(self, req: EngineCoreRequest) -> None:
        self.request_manager.validate(req)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.request_manager.add(req)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return self.request_manager.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.request_manager.has_unfinished()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> int:
        return self.request_manager.reset_prefix_cache(reset_running_requests)

    # -- pause / resume (PauseManager; a resume while asleep: SleepManager) ---------------
    def pause(self, mode: str, clear_cache: bool = True) -> list[EngineCoreOutput]:
        return self.pause_manager.pause(mode, clear_cache)

    def pause_complete(self) -> bool:
        return self.pause_manager.pause_complete()

    def finish_pause(self, clear_cache: bool) -> None:
        self.pause_manager.finish_pause(clear_cache)

    def resume(self) -> None:
        self.sleep_manager.resume()

    def is_paused(self) -> bool:
        return self.pause_manager.is_paused()

    # -- sleep (SleepManager) -------------------------------------------------------------
    def sleep(self, level: int, mode: str = "abort") -> list[EngineCoreOutput]:
        return self.sleep_manager.sleep(level, mode)

    def finish_sleep(self, level: int) -> None:
        self.sleep_manager.finish_sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, object]:
        return self.sleep_manager.wake_up(tags)

    # -- weights (WeightManager) ----------------------------------------------------------
    def load_weights_from_disk(
        self, model_dir: str, label: str | None = None
    ) -> list[EngineCoreOutput]:
        return self.weight_manager.load_from_disk(model_dir, label)

    def load_weights_inline(
        self, tensors: list[InlineTensor], label: str | None = None
    ) -> list[EngineCoreOutput]:
        return self.weight_manager.load_inline(tensors, label)

    def leave_weight_transfer(self) -> bool:
        return self.weight_manager.leave_transfer()

    def start_weight_update(
        self,
        is_checkpoint_format: bool = True,
        lora_name: str | None = None,
        lora_config: dict | None = None,
    ) -> None:
        self.weight_manager.start_update(is_checkpoint_format, lora_name, lora_config)

    def finish_weight_update(
        self, label: str | None = None, abort: bool = False, kv_policy: str | None = None
    ) -> list[EngineCoreOutput]:
        return self.weight_manager.finish_update(label, abort, kv_policy)

    def update_weight_version(self, label: str) -> list[EngineCoreOutput]:
        return self.weight_manager.commit(label)

    def get_weight_version(self) -> dict[str, int | str]:
        return self.weight_manager.get_version()

    def set_weight_label(self, label: str) -> dict[str, int | str]:
        return self.weight_manager.set_label(label)

    def weight_checksums(self) -> dict[str, str] | None:
        return self.weight_manager.checksums()

    def weight_info(self) -> dict[str, object]:
        return self.weight_manager.info()

    def committed_weights(self, digest: bool) -> dict[str, object]:
        return self.weight_manager.committed(digest)

    def close(self) -> None:
        """Stop the tensor-parallel workers (none without tensor parallelism)."""
        self.runner.close()

    # -- stats and RPC --------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | float | str]:
        return self.stats.get_stats()

    def collective_rpc(self, method: str, args: list, kwargs: dict) -> list:
        return self.rpc.call(method, args, kwargs)


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
