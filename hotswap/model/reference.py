"""The bf16 policy beside FP8 weights: a model built with `Fp8Config.keep_reference` keeps
each quantized weight in the model dtype too (its reference, model/reference_views.py),
kept equal through every write to what an unquantized engine holds; inside
`serving_reference(model)` its forward runs over the references through the paths a bf16
weight takes, so a finished FP8 rollout can be scored by the policy the trainer sent.

Memory: with references the weights take the model dtype's bytes plus the codes' (and a
double buffer's shadow holds both). Sleep offloads or discards the parameters only: the
references stay resident (weights/residency.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hotswap.model.layers import Linear
from hotswap.model.moe import FusedExperts
from hotswap.model.reference_views import REFERENCE_SWITCH, region_view

# A reference's name among the parameters the double buffer swaps (weights/double_buffer.py):
# its codes' parameter name and this ('#' is in no parameter name).
REFERENCE_SUFFIX = "#reference"


def fp8_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(the codes' parameter name, the FP8 layer) of every FP8 linear layer and stacked
    experts' parameter (a Linear, or an Fp8Stack: each has `weight`, `weight_scale_inv`
    and `fp8`)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.fp8 is not None:
            yield f"{name}.weight", module
        elif isinstance(module, FusedExperts) and module.fp8 is not None:
            for parameter, stack in module.fp8.items():
                yield f"{name}.{parameter}", stack


def has_references(model: nn.Module) -> bool:
    """Whether the model has FP8 layers and keeps their references."""
    layers = [layer for _, layer in fp8_layers(model)]
    return bool(layers) and all(layer.fp8.reference is not None for layer in layers)


def reference_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every reference, by its codes' parameter name + REFERENCE_SUFFIX."""
    return {name + REFERENCE_SUFFIX: layer.fp8.reference
            for name, layer in fp8_layers(model) if layer.fp8.reference is not None}  # fmt: skip


@contextlib.contextmanager
def serving_reference(model: nn.Module) -> Iterator[None]:
    """Inside, every FP8 linear layer of `model` computes x @ reference^T as a bf16 weight
    would (model/layers.py `linear`: the GEMV for a few rows), and the FP8 experts run the
    bf16 fused kernel or per-expert path over theirs; other models are unaffected. Run it
    eagerly: a compiled decode step refuses to recompile for it. A model with no FP8
    layer: nothing changes. ValueError if one keeps no reference."""
    layouts = []
    for name, layer in fp8_layers(model):
        if layer.fp8.reference is None:
            raise ValueError(
                f"serving_reference: FP8 layer {name!r} keeps no reference weight; the "
                f"model must be built with Fp8Config(keep_reference=True)"
            )
        layouts.append(layer.fp8)
    if not layouts:
        yield
        return
    for layout in layouts:
        layout.serving = True
    REFERENCE_SWITCH.active += 1
    try:
        yield
    finally:
        REFERENCE_SWITCH.active -= 1
        for layout in layouts:
            layout.serving = False


@torch.no_grad()
def refresh_references(model: nn.Module, everything: bool = False) -> None:
    """Derive the references of the codes written as sent since the last call (noted by
    model/reference_views.py note_codes_as_sent) as codes x scales in the model dtype, now
    that their scales are in: at every commit (the runner's weights_changed, after the
    double buffer's swap) and after the checkpoint loads. `everything`: every reference
    (dummy weights, written into the codes directly)."""
    for _, layer in fp8_layers(model):
        layout = layer.fp8
        if layout.reference is None:
            continue
        codes = layer.weight.data
        regions = [(0, tuple(codes.shape), codes.stride())] if everything else layout.stale
        for region in regions:
            _dequantize_into(layer, region_view(codes, region),
                             region_view(layout.reference, region))  # fmt: skip
        layout.stale = []


def _dequantize_into(layer: Any, codes: torch.Tensor, reference: torch.Tensor) -> None:
    """codes x scales into `reference` (float32 products rounded once to the model dtype,
    as the FP8 forward dequantizes): `codes` a range of whole rows of the layer's matrix
    (of one expert's), or of a range of experts' matrices."""
    param, scales = layer.weight.data, layer.weight_scale_inv.data
    offset = codes.storage_offset() - param.storage_offset()
    pairs = [(codes, reference, scales)]
    if param.dim() == 3:  # stacked experts: one matrix at a time
        expert, offset = divmod(offset, param.stride(0))
        if codes.dim() == 3:
            pairs = list(zip(codes, reference, scales[expert : expert + codes.shape[0]]))
        else:
            pairs = [(codes, reference, scales[expert])]
    first = offset // param.shape[-1]
    for matrix, out, matrix_scales in pairs:
        rows = layer.fp8.scale_rows.narrow(0, first, matrix.shape[0])
        out.copy_(layer.fp8.dequantize(matrix, matrix_scales, out.dtype, rows))
