"""What each control verb does to an engine core: one handler per verb in verbs.py.

A handler gets the core, the verb's (already validated) arguments and the list to append
outputs to (requests a call aborted); it returns the call's answer, or `Deferred` when the
answer must wait for a condition the engine-core loop checks between steps (a pause
completes when its mode's condition holds). The loop, `LLM` and the tests all dispatch
through `HANDLERS`; a verb without a handler is a test failure, not a runtime surprise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotswap.engine import verbs
from hotswap.engine.core import EngineCore
from hotswap.engine.messages import EngineCoreOutput
from hotswap.weight_transfer.backends import get_backend

Outputs = list[EngineCoreOutput]


@dataclass(frozen=True)
class Deferred:
    """Answer once `core.pause_complete()`; `complete` then finishes the call (clears
    caches, frees memory) and gives its answer."""

    complete: Callable[[], object]


def _pause(core: EngineCore, args: verbs.Pause, out: Outputs) -> Deferred:
    out.extend(core.pause(args.mode, args.clear_cache))
    return Deferred(lambda: core.finish_pause(args.clear_cache))


def _sleep(core: EngineCore, args: verbs.Sleep, out: Outputs) -> Deferred:
    out.extend(core.sleep(args.level, args.mode))
    return Deferred(lambda: core.finish_sleep(args.level))


def _load_weights_from_disk(
    core: EngineCore, args: verbs.LoadWeightsFromDisk, out: Outputs
) -> dict[str, Any]:
    out.extend(core.load_weights_from_disk(args.model_path, args.weight_version))
    return core.get_weight_version()


def _load_weights_inline(
    core: EngineCore, args: verbs.LoadWeightsInline, out: Outputs
) -> dict[str, Any]:
    out.extend(core.load_weights_inline(args.tensors, args.weight_version))
    return core.get_weight_version()


def _finish_weight_update(
    core: EngineCore, args: verbs.FinishWeightUpdate, out: Outputs
) -> dict[str, Any]:
    adapter = core.weight_manager.round_adapter()
    out.extend(core.finish_weight_update(args.weight_version, args.abort, args.kv_policy))
    answer = core.committed_weights(args.digest and not args.abort)
    if adapter is not None and not args.abort:  # the adapter's version, not the weights'
        answer.update(lora_name=adapter, lora_version=core.loras.adapters[adapter].version)
    if args.checksum and not args.abort:
        answer["checksums"] = core.weight_checksums()
    return answer


def _update_weight_version(
    core: EngineCore, args: verbs.UpdateWeightVersion, out: Outputs
) -> dict[str, Any]:
    out.extend(core.update_weight_version(args.label))
    return core.get_weight_version()


def _collective_rpc(core: EngineCore, args: verbs.CollectiveRpc, out: Outputs) -> list:
    """One result per tensor-parallel rank: the DP front-end concatenates the cores' lists
    (Merge.PER_RANK).
    `reload_weights` is vLLM's built-in worker method (reload the served checkpoint, e.g.
    after a level-2 sleep) unless the extension defines its own: here a disk reload of
    the model directory, committed as a new version."""
    extension = core.rpc.extension
    if args.method == "reload_weights" and (
        extension is None or "reload_weights" not in extension.methods
    ):
        out.extend(core.load_weights_from_disk(str(core.config.model.path)))
        return [None] * core.config.tensor_parallel_size
    return core.collective_rpc(args.method, args.args, args.kwargs)


def _get_world_size(core: EngineCore, args: verbs.GetWorldSize, out: Outputs) -> int:
    transfer, config = core.weight_sync.transfer, core.config.weight_transfer
    if transfer is not None:
        return transfer.world_size()
    if config is None:
        return 1
    return get_backend(config.backend).receivers(core.config.tensor_parallel_size)


def _load_lora_adapter(
    core: EngineCore, args: verbs.LoadLoraAdapter, out: Outputs
) -> dict[str, Any]:
    in_use = core.request_manager.adapters_in_use()
    return core.loras.load(args.lora_name, args.lora_path, args.load_inplace, in_use,
                           args.prepare)  # fmt: skip


Handler = Callable[[EngineCore, Any, Outputs], object]

HANDLERS: dict[str, Handler] = {
    "pause": _pause,
    "resume": lambda core, args, out: core.resume(),
    "is_paused": lambda core, args, out: core.is_paused(),
    "reset_prefix_cache": lambda core, args, out: core.reset_prefix_cache(
        args.reset_running_requests
    ),
    "get_stats": lambda core, args, out: core.get_stats(),
    "sleep": _sleep,
    "wake_up": lambda core, args, out: core.wake_up(args.tags),
    "is_sleeping": lambda core, args, out: core.sleep_state.is_sleeping,
    "load_weights_from_disk": _load_weights_from_disk,
    "load_weights_inline": _load_weights_inline,
    "init_weight_transfer_engine": lambda core, args, out: core.weight_sync.init(args.init_info),
    "leave_weight_transfer": lambda core, args, out: core.leave_weight_transfer(),
    "start_weight_update": lambda core, args, out: core.start_weight_update(
        args.is_checkpoint_format, args.lora_name, args.lora_config
    ),
    "update_weights": lambda core, args, out: core.weight_sync.update(args.update_info),
    "prepare_weight_update": lambda core, args, out: core.weight_sync.prepare(),
    "finish_weight_update": _finish_weight_update,
    "get_world_size": _get_world_size,
    "get_weight_info": lambda core, args, out: core.weight_info(),
    "update_weight_version": _update_weight_version,
    "get_weight_version": lambda core, args, out: core.get_weight_version(),
    "update_weight_label": lambda core, args, out: core.set_weight_label(args.label),
    "weight_update_active": lambda core, args, out: core.weight_sync.round_open,
    "collective_rpc": _collective_rpc,
    "get_weight_checksums": lambda core, args, out: core.weight_checksums() or {},
    "load_lora_adapter": _load_lora_adapter,
    "commit_lora_adapter": lambda core, args, out: core.loras.commit_pending(
        args.lora_name, args.abort, core.request_manager.adapters_in_use()
    ),
    "unload_lora_adapter": lambda core, args, out: core.loras.unload(args.lora_name),
    "list_lora_adapters": lambda core, args, out: core.loras.list(),
}


def run_now(core: EngineCore, args: verbs.Args) -> tuple[object, Outputs]:
    """Run a verb to its answer on an engine with nothing in flight between calls (the
    offline `LLM`): a deferred answer is complete at once there."""
    out: Outputs = []
    result = HANDLERS[verbs.verb_name(args)](core, args, out)
    if isinstance(result, Deferred):
        if not core.pause_complete():
            raise RuntimeError(f"{verbs.verb_name(args)}: cannot complete with requests running")
        result = result.complete()
    return result, out
