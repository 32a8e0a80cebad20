"""Writes into the model's weights that every tensor-parallel rank makes alike: checkpoint
tensors (each rank keeps its slice), sparse deltas, and sleep's offload and restore.

Mixed into ModelRunner (which provides `model`, `tp` and `residency`). Rank 0 sends each
whole checkpoint tensor over the group, so any weight-transfer backend feeds a
tensor-parallel engine unchanged (vLLM's default behaviour: every rank keeps its part)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hotswap.config import EngineConfig
from hotswap.execution.ranks import on_every_rank
from hotswap.model.parallel import TPGroup, check_whole_shape
from hotswap.model.quantized import write_flat, write_part
from hotswap.weights.residency import WeightResidency


class RankWeights:
    config: EngineConfig
    model: torch.nn.Module
    tp: TPGroup
    residency: WeightResidency
    # The ranks' second channel (execution/ranks.py), for weight transfers that every rank
    # receives itself (the m2n backend), alongside steps on the first.
    transfer_channel: TPGroup
    # Each rank's received part of a round's tensors, written into the model at the commit.
    rank_stage: dict[str, torch.Tensor]

    # -- every rank receives (weight_transfer/m2n.py's RankTransfer) ----------------------
    @property
    def engine_rank(self) -> int:
        """This rank among every receiving rank of a data-parallel server: core i's
        tensor-parallel rank r is i * tp + r."""
        return self.config.data_parallel_rank * self.tp.size + self.tp.rank

    @property
    def tp_size(self) -> int:
        return self.tp.size

    def checkpoint_part(self, name: str) -> tuple[tuple[int, ...], Any] | None:
        """(checkpoint tensor `name`'s whole shape, this rank's (dim, start, size) of it or
        None: all); None if the model ignores it; ValueError if it has no such tensor, or
        if this rank's share of it is no single slice (a stacked gate_up_proj of experts)."""
        shape = self.model.checkpoint_shape(name)
        if shape is None:
            return None
        piece = self.model.checkpoint_slice(name)
        return shape, None if piece is None else (piece.dim, piece.start, piece.size)

    def tell_workers(self, call: tuple[str, tuple]) -> None:
        if self.transfer_channel.parallel:
            self.transfer_channel.broadcast_object(call)

    def gather_errors(self, error: str | None) -> list[str | None]:
        return self.transfer_channel.gather_objects(error)

    @on_every_rank
    @torch.no_grad()
    def commit_stage(self, names: list[str]) -> None:
        """Every rank writes its received parts of `names` into its model (a dropped
        round's are forgotten by `drop_received`, weights/double_buffer.py)."""
        for name in names:
            staged = self.rank_stage.pop(name, None)
            target = self.model.checkpoint_view(name)
            if staged is not None and target is not None:
                write_part(self.model, name, target[1], staged)
        self.rank_stage.clear()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (whole) into every rank's share; returns the keys written
        (as the model's `load_weights`). Shapes are checked before any rank writes."""
        if not (self.tp.parallel and self.tp.rank == 0):
            return self.model.load_weights(weights)
        pairs = [(name, tensor.contiguous()) for name, tensor in weights]
        for name, tensor in pairs:
            self._check_shape(name, tensor)
        metas = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in pairs]
        self.tp.broadcast_object(("receive_weights", (metas,)))
        loaded: set[str] = set()
        for name, tensor in pairs:
            loaded |= self.model.load_weights([(name, self.tp.broadcast(tensor))])
        return loaded

    def _check_shape(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.model.checkpoint_shape(name)  # whole tensors: any share loads
        if expected is not None:
            check_whole_shape(name, tensor, expected)

    @torch.no_grad()
    def receive_weights(self, metas: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Rank 1..: the tensors rank 0's `load_weights` sends, one at a time."""
        for name, shape, dtype in metas:
            buffer = self.tp.broadcast(torch.empty(shape, dtype=dtype))
            self.model.load_weights([(name, buffer.to(self.model_device))])

    @property
    def model_device(self) -> torch.device:
        return next(self.model.parameters()).device

    @on_every_rank
    @torch.no_grad()
    def apply_deltas(self, deltas: list[tuple[str, Any]]) -> None:
        """Sparse changes to checkpoint tensors (weight_transfer's `Delta`: flat `indices`
        into the whole tensor, `values`): each rank writes those that fall in its slice.
        A tensor whose share is no single slice was refused on receipt (WeightTargets)."""
        for name, delta in deltas:
            target = self.model.checkpoint_view(name)
            if target is None:
                continue
            view = target[1]  # checkpoint views are contiguous row ranges
            indices, values = delta.indices.to(view.device), delta.values.to(view.device)
            piece = self.model.checkpoint_slice(name) if self.tp.parallel else None
            if piece is not None:
                mask, indices = piece.local_indices(piece.full_shape(tuple(view.shape)), indices)
                values = values[mask]
            write_flat(self.model, name, view, indices, values)

    @on_every_rank
    def offload_weights(self, keep: bool) -> None:
        """Sleep: the weights to a host backup (`keep`), or dropped."""
        if keep:
            self.residency.offload()
        else:
            self.residency.discard()

    @on_every_rank
    def restore_weights(self) -> bool:
        """Wake: True if the weights are the pre-sleep ones (on every rank)."""
        return all(self.tp.gather_objects(self.residency.restore()))
