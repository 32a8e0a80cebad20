"""What a round may write into a model: where each sent tensor lands, whether its shape
and dtype fit there, and whether a round covers every weight. Checked before a byte is
received, so a refused chunk never touches the stage."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.model.quantized import quantized_send_refusal, receipt_refusal
from hotswap.weight_transfer.base import ParamMeta


class WeightTargets:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # (checkpoint format?, name) -> (shape, is floating, dtype) or None (ignored)
        self._destinations: dict[tuple[bool, str], Any] = {}

    def target(self, name: str, checkpoint: bool) -> tuple[str, torch.Tensor] | None:
        if checkpoint:
            return self.model.checkpoint_view(name)
        params = self.model.parameter_index()
        if name not in params:
            raise ValueError(f"weights: unknown parameter {name!r} (engine format)")
        return name, params[name].data

    def check(
        self, meta: ParamMeta, checkpoint: bool, sparse: bool = False
    ) -> tuple[str, str] | None:
        """None if the model can take `meta`'s tensor (`sparse`: as a delta); else (what
        is wrong with it: name, shape or dtype; why)."""
        tp = getattr(self.model, "tp", None)  # an adapter's stage has none
        sliced = checkpoint and tp is not None and tp.parallel
        refused = quantized_send_refusal(meta.name, meta.dtype, sparse, sliced)
        if refused is not None:
            return refused
        try:
            expected = self.destination(meta.name, checkpoint)
            if sparse and checkpoint and expected is not None:
                self._single_slice(meta.name)
        except ValueError as e:
            return "name", str(e)
        if expected is None:
            return None  # a name the model ignores (e.g. rotary inv_freq)
        shape, floating, dtype = expected
        refused = receipt_refusal(meta.name, meta.dtype, dtype, checkpoint)
        if refused is not None:
            return refused
        if shape != meta.shape:
            return "shape", (
                f"weights: shape mismatch for {meta.name!r}: sent {list(meta.shape)}, "
                f"model expects {list(shape)}"
            )
        if floating != meta.dtype.is_floating_point:
            return "dtype", (
                f"weights: dtype mismatch for {meta.name!r}: sent {meta.dtype}, model {dtype}"
            )
        return None

    def destination(
        self, name: str, checkpoint: bool
    ) -> tuple[tuple[int, ...], bool, torch.dtype] | None:
        """(shape, is floating, dtype) of where `name` is written; None if ignored.
        Cached: a model's parameter names, shapes and dtypes never change."""
        key = (checkpoint, name)
        if key in self._destinations:
            return self._destinations[key]
        target = self.target(name, checkpoint)
        if target is None:
            found = None
        else:
            dest = target[1]
            found = (self._full_shape(name, dest, checkpoint), dest.is_floating_point(),
                     dest.dtype)  # fmt: skip
            if not dest.numel():
                return found  # maybe a sleeping placeholder (rounds refuse then): not cached
        self._destinations[key] = found
        return found

    def _full_shape(self, name: str, dest: torch.Tensor, checkpoint: bool) -> tuple[int, ...]:
        """The shape sent for `name`: the whole checkpoint tensor, of which a
        tensor-parallel rank holds a share (an adapter's stage holds whole tensors)."""
        shape_of = getattr(self.model, "checkpoint_shape", None)
        return shape_of(name) if checkpoint and shape_of is not None else tuple(dest.shape)

    def _single_slice(self, name: str) -> None:
        """ValueError unless this rank's share of checkpoint tensor `name` is one slice of
        it, where a delta's flat indices can be mapped (not a stacked gate_up_proj of
        experts under tensor parallelism)."""
        slice_of = getattr(self.model, "checkpoint_slice", None)
        if slice_of is not None:
            slice_of(name)

    def missing(self, staged: set[str], checkpoint: bool) -> list[str]:
        if not checkpoint:
            return sorted({n for n, _ in self.model.named_parameters()} - staged)
        keys = set()
        for name in staged:
            target = self.model.checkpoint_view(name)
            if target is not None:
                keys.add(target[0])
        keys = self.model.expand_keys(keys)
        scale_keys = getattr(self.model, "scale_keys", None)  # FP8: quantized on receipt
        if scale_keys is not None:
            keys |= scale_keys(keys)
        return sorted(self.model.expected_checkpoint_keys() - keys)

    def check_complete(self, staged: set[str], checkpoint: bool) -> None:
        missing = self.missing(staged, checkpoint)
        if missing:
            shown = ", ".join(missing[:3]) + (
                f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            )
            raise InvalidArgument(
                None,  # the round as a whole, not one argument of the call
                f"weights: the round does not cover every weight (missing weights for "
                f"{shown}); nothing was applied",
            )


# The update_info list holding each part of a tensor's meta (vLLM's keys: TensorsInfo).
_META_LISTS = {"name": "names", "shape": "shapes", "dtype": "dtype_names"}


def claimed_entry(update_info: dict[str, Any], what: str, index: int) -> str:
    """The field of `update_info` that claimed the `what` (name, shape, dtype) of its
    `index`-th tensor, where the backend's info lists its tensors (else update_info)."""
    key = _META_LISTS[what]
    listed = update_info.get(key)
    return (
        f"update_info.{key}[{index}]"
        if isinstance(listed, list) and index < len(listed)
        else "update_info"
    )
