"""One weight round's state: what it writes into (the model or a LoRA adapter's stage)
and what it has received so far."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.lora.stage import AdapterStage
from hotswap.model.parallel import ShardSlice, TensorParallelError
from hotswap.model.quantized import codes_of_scale, unpaired_fp8, write_flat
from hotswap.weight_transfer.base import Delta
from hotswap.weight_transfer.config import WeightTransferConfig
from hotswap.weight_transfer.engine import STAGED
from hotswap.weights.double_buffer import ShadowWeights, Target
from hotswap.weights.targets import WeightTargets


@dataclass
class Round:
    is_checkpoint_format: bool
    targets: WeightTargets  # what the round writes: the model, or a LoRA adapter's stage
    # When a call last touched the round: a round idle past the round timeout is aborted.
    last_call: float = field(default_factory=time.monotonic)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    deltas: list[tuple[str, Delta]] = field(default_factory=list)  # applied after `staged`
    in_shadow: bool = False  # written into the double buffer: the commit is a swap
    # checkpoint names sent as FP8 codes a trainer quantized, and FP8 scale names sent:
    # they must pair up (model/quantized.py unpaired_fp8) before anything is applied
    fp8_codes: set[str] = field(default_factory=set)
    fp8_scales: set[str] = field(default_factory=set)

    def note_sent(self, metas: Iterable[Any]) -> None:
        """Record the trainer-quantized tensors among received `metas` (ParamMeta)."""
        for meta in metas:
            if meta.dtype == torch.float8_e4m3fn:
                self.fp8_codes.add(meta.name)
            elif codes_of_scale(meta.name) is not None:
                self.fp8_scales.add(meta.name)

    def check_fp8_pairs(self) -> None:
        """InvalidArgument (the round as a whole) unless every FP8 weight sent as codes
        came with its scales and every scale with its codes."""
        why = unpaired_fp8(self.fp8_codes, self.fp8_scales)
        if why is not None:
            raise InvalidArgument(None, why)

    @property
    def adapter(self) -> AdapterStage | None:
        """The adapter the round is received into (None: the model's weights)."""
        model = self.targets.model
        return model if isinstance(model, AdapterStage) else None

    def must_be_complete(self, config: WeightTransferConfig | None) -> bool:
        """A new adapter is sent whole; the model, when the config requires it."""
        adapter = self.adapter
        if adapter is not None:
            return adapter.complete_required
        return config is not None and config.require_complete


class WeightApplyError(RuntimeError):
    """Writing a validated stage into the model failed midway (not expected: shapes and
    dtypes were checked). The weights are then incomplete and no step runs until a
    complete round or a reload succeeds."""


def fresh_allocator(device: torch.device):  # noqa: ANN202 - an Allocator
    return lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device)


def drain(items: Iterator[tuple[str, torch.Tensor]]) -> None:
    for _ in items:
        pass


class ModelWriter(Protocol):
    """Writes checkpoint tensors and sparse deltas into a model (ModelRunner: on every
    tensor-parallel rank)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...
    def apply_deltas(self, deltas: list[tuple[str, Delta]]) -> None: ...
    def commit_stage(self, names: list[str]) -> None:
        """Write every rank's received parts of `names` (m2n rounds)."""


class RankWriter(ModelWriter, Protocol):
    """The engine's model writer (ModelRunner), which also holds each tensor-parallel
    rank's double buffer (weights/double_buffer.py)."""

    def rank_shadow(self) -> ShadowWeights: ...
    def write_shadow(self, target: Target, item: Any, piece: ShardSlice | None) -> torch.Tensor: ...
    def forward_to_shadows(self, items: list[tuple[str, Any]]) -> None: ...
    def swap_shadow(self) -> None: ...
    def drop_received(self) -> None: ...
    def release_shadow(self) -> None: ...


class LocalWriter:
    """ModelWriter for a model (or an adapter's stage) in this process alone."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.model.load_weights(weights)

    def apply_deltas(self, deltas: list[tuple[str, Delta]]) -> None:
        for name, delta in deltas:
            target = self.model.checkpoint_view(name)
            if target is not None:  # checkpoint views are contiguous row ranges
                write_flat(self.model, name, target[1], delta.indices, delta.values)

    def commit_stage(self, names: list[str]) -> None:
        """Nothing is received on other ranks for a model in this process alone."""


def write_round(round_: Round, writer: ModelWriter) -> None:
    """Write a closed round's stage through `writer`: whole tensors, every rank's staged
    parts (m2n), then deltas. Every staged tensor was checked against its destination, so
    the copies cannot fail on the data; no backup is kept (it would double a sync's cost):
    a copy that still fails marks the weights incomplete (WeightApplyError) instead of
    serving them half-written; ranks that failed stop the engine (TensorParallelError)."""
    model = round_.targets.model
    try:
        if round_.is_checkpoint_format:
            on_ranks = [name for name, item in round_.staged.items() if item is STAGED]
            writer.load_weights((name, item) for name, item in round_.staged.items()
                                if item is not STAGED)  # fmt: skip
            if on_ranks:
                writer.commit_stage(on_ranks)
            if round_.deltas:
                writer.apply_deltas(round_.deltas)
        else:
            params = model.parameter_index()
            for name, tensor in round_.staged.items():
                params[name].copy_(tensor)
            for name, delta in round_.deltas:
                flat = params[name].data.view(-1)
                flat[delta.indices] = delta.values.to(flat.dtype)
    except TensorParallelError:
        raise  # the ranks failed: nothing serves again (every later collective refuses)
    except Exception as e:
        raise WeightApplyError(
            f"finish_weight_update: writing the weights failed midway ({type(e).__name__}: "
            f"{e}); the weights are incomplete: no step runs until a complete round or a "
            f"reload succeeds"
        ) from e
