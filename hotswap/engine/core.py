"""EngineCore: owns the scheduler and the model runner; one `step()` is one batch.

The core composes one manager per concern; each handles the control verbs on its state
(`@handles(Verb)`, handlers.py), and the core keeps only what its step loops need (adding,
aborting, stepping, and whether a pause is complete):

- `RequestManager` (request_manager.py): admitting, aborting and advancing requests;
- `PauseManager` (pause.py): pause states and when a pause call may return;
- `SleepManager` (sleep.py): sleep levels, what they free, and waking by tag;
- `WeightManager` (weights/manager.py): every write of the weights and the version it
  commits, the trainer's channel;
- `LoRAManager` (lora/manager.py): the LoRA adapters by name and version;
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
from hotswap.engine.handlers import Deferred, Outputs, bind, handler_table
from hotswap.engine.messages import EngineCoreOutput, EngineCoreRequest
from hotswap.engine.pause import PauseManager
from hotswap.engine.request_manager import RequestManager
from hotswap.engine.rpc import WorkerRpc
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sleep import SleepManager, SleepState
from hotswap.engine.stats import EngineStats
from hotswap.engine.verbs import Args, verb_name
from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner
from hotswap.lora.manager import LoRAManager
from hotswap.weights.manager import WeightManager
from hotswap.weights.sync import WeightSync

# The managers a core is composed of; every control verb is handled by one of them.
MANAGERS = (RequestManager, PauseManager, SleepManager, WeightManager, LoRAManager, EngineStats,
            WorkerRpc)  # fmt: skip
HANDLERS = handler_table(MANAGERS)  # verb name -> (the manager class, its handler's name)


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
            config.lora,
            self.runner.model,
            config.model.dtype,
            config.allowed_weight_dirs,
            lambda: self.request_manager.adapters_in_use(),
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
        self.stats = EngineStats(scheduler, runner, sleep_state, self.weight_sync, self.versions,
                                 self.request_manager.scorer.gap)  # fmt: skip
        self.rpc = WorkerRpc(config, runner, self.weight_manager.load_from_disk)
        # Each verb's handler, bound to this core's manager of its class, by Args class.
        self.handlers = bind(HANDLERS, vars(self).values())

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

    def abort_requests(
        self, request_ids: Iterable[str], stopped: bool = False
    ) -> list[EngineCoreOutput]:
        """`stopped`: a stop string ended them in the front end (EngineCoreClient's)."""
        return self.request_manager.abort(request_ids, stopped=stopped)

    def has_unfinished_requests(self) -> bool:
        return self.request_manager.has_unfinished()

    # -- control verbs (each handled by its manager) and when a pause is complete ----------
    def pause_complete(self) -> bool:
        return self.pause_manager.pause_complete()

    def run_now(self, args: Args) -> tuple[object, Outputs]:
        """Run a verb to its answer on an engine with nothing in flight between calls (the
        offline `LLM`): a deferred answer is complete at once there."""
        out: Outputs = []
        result = self.handlers[type(args)](args, out)
        if isinstance(result, Deferred):
            if not self.pause_complete():
                raise RuntimeError(f"{verb_name(args)}: cannot complete with requests running")
            result = result.complete()
        return result, out

    def close(self) -> None:
        """Stop the tensor-parallel workers (none without tensor parallelism)."""
        self.runner.close()


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
