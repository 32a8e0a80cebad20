"""`collective_rpc` in the engine core: calls into the worker extension (worker.py), on every
tensor-parallel rank of the core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hotswap.config import EngineConfig
from hotswap.engine.extension import WorkerExtension, load_extension_class
from hotswap.engine.handlers import Outputs, handles
from hotswap.engine.messages import EngineCoreOutput
from hotswap.engine.verbs import CollectiveRpc
from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner
from hotswap.model.parallel import TPGroup

RPC_CALL = "worker_rpc"  # the call rank 0 sends the other ranks (execution/rank_process.py)
RELOAD_WEIGHTS = "reload_weights"  # vLLM's built-in worker method


class WorkerRpc:
    """The worker extension named by `worker_extension_cls`, if any, and calls into it.

    Invariants: a call runs on the engine-core loop between two steps, so no step sees
    what it half-wrote; under tensor parallelism it runs on every rank (each with its own
    extension over its own share of the model), in the order rank 0 sends it, and answers
    one result per rank; whatever it did, every rank is told afterwards that the weights
    may have changed (derived copies are remade), but no version is committed: that takes
    `update_weight_version`."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        load_from_disk: Callable[[str], list[EngineCoreOutput]],
    ) -> None:
        self.config = config
        self.runner = runner
        self.load_from_disk = load_from_disk  # a disk reload, committed (WeightManager's)
        self.extension: WorkerExtension | None = None
        if config.worker_extension_cls is not None:
            self.extension = make_extension(config, runner)

    @handles(CollectiveRpc)
    def on_collective_rpc(self, args: CollectiveRpc, out: Outputs) -> list[Any]:
        """One result per tensor-parallel rank: the DP front-end concatenates the cores'
        lists (Merge.PER_RANK). `reload_weights` is vLLM's built-in worker method (reload
        the served checkpoint, e.g. after a level-2 sleep) unless the extension defines its
        own: here a disk reload of the model directory, committed as a new version."""
        extension = self.extension
        if args.method == RELOAD_WEIGHTS and (
            extension is None or RELOAD_WEIGHTS not in extension.methods
        ):
            out.extend(self.load_from_disk(str(self.config.model.path)))
            return [None] * self.config.tensor_parallel_size
        return self.call(args.method, args.args, args.kwargs)

    def call(self, method: str, args: list, kwargs: dict) -> list[Any]:
        """Call a method of the worker extension (see worker.py) on every rank: their
        results in rank order (vLLM answers one per worker)."""
        if self.extension is None:
            raise InvalidArgument("method", "method: collective_rpc needs a worker extension: "
                                  "start the engine with --worker-extension-cls")  # fmt: skip
        extension = self.extension
        extension.check(method)  # the same methods on every rank: refused before any runs
        tp = self.runner.tp
        if tp.parallel:
            tp.broadcast_object((RPC_CALL, (method, args, kwargs)))
        try:
            results, error = run_everywhere(tp, lambda: extension.call(method, args, kwargs))
        finally:
            self.runner.weights_changed()  # the method may have written weights
        if error is not None:
            raise error
        return results


def make_extension(config: EngineConfig, runner: ModelRunner) -> WorkerExtension:
    """The extension of one rank; `rank` as vLLM's workers number themselves across the
    server: data-parallel rank x tensor_parallel_size + tensor-parallel rank."""
    assert config.worker_extension_cls is not None
    cls = load_extension_class(config.worker_extension_cls)
    rank = config.data_parallel_rank * config.tensor_parallel_size + runner.tp.rank
    return WorkerExtension(cls, runner, runner.device, rank)


def run_everywhere(tp: TPGroup, run: Callable[[], Any]) -> tuple[list[Any], Exception | None]:
    """This rank's part of a call every rank makes, then every rank's (result, error)
    gathered: the results in rank order, and the first error (this rank's own as it was
    raised; another rank's as a RuntimeError naming it), or None."""
    result, error = None, None
    try:
        result = run()
    except Exception as e:  # noqa: BLE001 - answered after every rank has run
        error = e
    message = None if error is None else f"{type(error).__name__}: {error}"
    answers = tp.gather_objects((result, message))
    if error is None:
        failed = [(rank, text) for rank, (_, text) in enumerate(answers) if text is not None]
        if failed:
            error = RuntimeError(f"collective_rpc: tensor-parallel rank {failed[0][0]} "
                                 f"failed: {failed[0][1]}")  # fmt: skip
    return [value for value, _ in answers], error
