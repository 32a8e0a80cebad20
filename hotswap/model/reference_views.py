"""Where an FP8 layer's reference weight lies (`Fp8Config.keep_reference`: the weight in the
model dtype beside its e4m3 codes, for scoring with the unquantized policy), and how each
write into the codes keeps it equal to what a bf16 engine would hold:

- a bf16/float32 tensor quantized on receipt: its reference view gets the tensor;
- a sparse delta: the same flat indices of the reference get the values (as a bf16
  engine scatters them, not the requantized values);
- FP8 codes written as sent (an FP8 checkpoint, a round a trainer quantized): no tensor
  in the model dtype exists, so the reference becomes codes x scales, noted here and
  derived at the commit (model/reference.py refresh_references), when the scales, sent
  as a tensor of their own, are in.

The reference has the codes' shape and strides, so the view matching any view of the codes
(a tensor-parallel share, one shard of a fused q/k/v or gate/up layer, one expert's
matrix, a 3-D stack of experts) lies at the same storage offset. An FP8 layer here is any
`owner` with the codes in `weight`, scales in `weight_scale_inv` and the layout (an
Fp8Layout, model/quantized.py) in `fp8`: a Linear, or a stacked experts' Fp8Stack.

The switch that makes the forward paths read the references (serving_reference) is a
module-level counter, read first, so a step outside it costs one attribute read per layer
and a compiled decode step keeps its graph.
"""

from __future__ import annotations

from typing import Any

import torch

# Where a view lies in a tensor: (element offset from the tensor's first, shape, strides).
Region = tuple[int, tuple[int, ...], tuple[int, ...]]


class ReferenceSwitch:
    """How many models serve their reference weights now (model/reference.py
    serving_reference). The FP8 forward paths read `active` first (a compiled decode step
    guards on its value, 0, so it never recompiles for it), and their layout's `serving`
    only when it is not 0: a model's switch leaves other models in the process alone."""

    def __init__(self) -> None:
        # an instance attribute from the start: the graphs' guard is then on its value (a
        # class attribute shadowed later would fail their guard even when back at 0)
        self.active = 0


REFERENCE_SWITCH = ReferenceSwitch()


def serves_reference(layout: Any) -> bool:
    """Whether a forward through the FP8 layer of `layout` reads its reference."""
    return REFERENCE_SWITCH.active > 0 and layout.serving


def region_of(base: torch.Tensor, view: torch.Tensor) -> Region:
    """Where `view` lies in `base`, or in a tensor laid out alike (the double buffer's
    shadow of it: both are whole tensors, their first elements at the same storage offset,
    as model/quantized.py scale_view_for assumes too)."""
    return view.storage_offset() - base.storage_offset(), tuple(view.shape), view.stride()


def region_view(base: torch.Tensor, region: Region) -> torch.Tensor:
    offset, shape, stride = region
    return base.as_strided(shape, stride, base.storage_offset() + offset)


def reference_view(owner: Any, codes_view: torch.Tensor) -> torch.Tensor | None:
    """The elements of FP8 layer `owner`'s reference that `codes_view`'s codes stand for
    (a view of its `weight`, or of the shadow's copy of it). None: the layer keeps none."""
    reference = owner.fp8.reference
    if reference is None:
        return None
    return region_view(reference, region_of(owner.weight.data, codes_view))


def note_codes_as_sent(owner: Any, codes_view: torch.Tensor) -> None:
    """FP8 codes were written as sent into `codes_view` (of the live codes): its reference
    is derived from codes x scales at the commit."""
    if owner.fp8.reference is not None:
        owner.fp8.stale.append(region_of(owner.weight.data, codes_view))


@torch.no_grad()
def set_reference(reference: torch.Tensor | None, part: torch.Tensor) -> None:
    """A received bf16/float32 part into its reference view (None: none kept), rounded to
    the model dtype as a bf16 engine's copy rounds it."""
    if reference is not None:
        reference.copy_(part)


@torch.no_grad()
def set_reference_flat(
    reference: torch.Tensor | None, indices: torch.Tensor, values: torch.Tensor
) -> None:
    """A sparse delta (flat `indices` of a contiguous view set to `values`) into its
    reference view, as a bf16 engine scatters it."""
    if reference is not None:
        flat = reference.view(-1)
        flat[indices.to(flat.device)] = values.to(flat.device, flat.dtype)
