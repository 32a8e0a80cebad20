"""`collective_rpc` in the engine core: calls into the worker extension (worker.py)."""

from __future__ import annotations

import torch

from hotswap.config import EngineConfig
from hotswap.engine.worker import WorkerExtension, load_extension_class
from hotswap.errors import InvalidArgument
from hotswap.model.runner import ModelRunner


class WorkerRpc:
    """The worker extension named by `worker_extension_cls`, if any, and calls into it.

    Invariants: a call runs on the engine-core loop between two steps, so no step sees
    what it half-wrote; whatever it did, the runner is told afterwards that the weights
    may have changed (derived copies are remade), but no version is committed: that takes
    `update_weight_version`."""

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.runner = runner
        self.extension: WorkerExtension | None = None
        if config.worker_extension_cls is not None:
            cls = load_extension_class(config.worker_extension_cls)
            device, rank = torch.device(config.device), config.data_parallel_rank
            self.extension = WorkerExtension(cls, runner, device, rank)

    def call(self, method: str, args: list, kwargs: dict) -> object:
        """Call a method of the worker extension (see worker.py)."""
        if self.extension is None:
            raise InvalidArgument("method", "method: collective_rpc needs a worker extension: "
                                  "start the engine with --worker-extension-cls")  # fmt: skip
        try:
            return self.extension.call(method, args, kwargs)
        finally:
            self.runner.weights_changed()  # the method may have written weights
