"""The worker extension (vLLM's `--worker-extension-cls`): a class named at server start
whose public methods `collective_rpc` calls inside the engine core, for frameworks that
run their own weight-loading code in the engine (verl, OpenRLHF, PipelineRL, TRL).

The methods see `self` as vLLM's workers do: `self.model_runner.model` (with
`load_weights(weights)` taking (name, tensor) pairs), `self.device`, `self.rank`. Under
tensor parallelism every rank has its own (its `model_runner` holds its share of the
model, whose `load_weights` takes whole checkpoint tensors and keeps its slices). They
run on the engine-core loop between two steps, so no step sees a half-loaded model; a
method that waits for a trainer blocks the loop meanwhile, as in vLLM. Weights loaded this
way are not a commit: follow with `update_weight_version` to give them a version.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import msgspec
import torch

from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner


class EngineWorker:
    """vLLM's worker attributes, for extension methods."""

    def __init__(self, runner: ModelRunner, device: torch.device, rank: int) -> None:
        self.model_runner = runner
        self.device = device
        self.rank = rank


def load_extension_class(path: str) -> type:
    module_name, _, class_name = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls: cannot import {path!r}: {e}") from e
    if not inspect.isclass(cls):
        raise ValueError(f"worker_extension_cls: {path!r} is not a class")
    return cls


class WorkerExtension:
    """The extended worker and the methods a call may name: the public callables the
    extension class itself defines (or inherits from its own bases), nothing of ours."""

    def __init__(self, cls: type, runner: ModelRunner, device: torch.device, rank: int) -> None:
        extended = type(f"Extended{cls.__name__}", (cls, EngineWorker), {})
        self.worker = extended.__new__(extended)
        EngineWorker.__init__(self.worker, runner, device, rank)
        if cls.__init__ is not object.__init__:
            cls.__init__(self.worker)
        self.methods = {
            name
            for klass in cls.__mro__
            if klass is not object
            for name, value in vars(klass).items()
            if not name.startswith("_") and callable(value)
        }

    def check(self, method: str) -> None:
        if method not in self.methods:
            raise InvalidArgument(
                "method", f"method: {method!r} is not a method of the worker extension "
                f"(declared: {', '.join(sorted(self.methods)) or 'none'})",
            )  # fmt: skip

    def call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        self.check(method)
        return _serialisable(getattr(self.worker, method)(*args, **kwargs))


def _serialisable(result: Any) -> Any:
    """As vLLM's route answers: JSON-like results as they are, anything else as text."""
    try:
        msgspec.msgpack.encode(result)
    except (TypeError, msgspec.EncodeError):
        return str(result)
    return result
