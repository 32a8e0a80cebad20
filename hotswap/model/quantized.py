"""Linear layers with blockwise FP8 weights (`--quantization fp8`; hotswap/quantization):
the `weight` parameter holds e4m3 codes and `weight_scale_inv` one float32 scale per block,
as vLLM names them, so an FP8 checkpoint loads as it is and a digest of the parameters is
a digest of what is served.

A fused layer (q/k/v, gate/up) keeps each checkpoint tensor's own block grid: a trainer or
a checkpoint quantizes `q_proj`, `k_proj` and `v_proj` one by one, and the engine, which
quantizes what it receives (`write`), must hold the same codes. So `scale_rows` gives each
output row its scale row, and a shard of `rows` output rows owns ceil(rows / block_n) scale
rows of its own.

Forward: on CUDA every batch through the Triton GEMM that reads the codes in place
(model/cuda/fp8_kernels.py); on the CPU up to `MATVEC_MAX_ROWS` rows through the CPU
kernel that reads the codes (half the bytes of bf16) and dequantizes them in registers,
and larger batches dequantize the weight into the activation dtype first (as the GEMM
library needs a plain weight), which every device can do with torch operators.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.model.kernels import LayerKernels
from hotswap.model.reference_views import (
    Region,
    note_codes_as_sent,
    reference_view,
    set_reference,
    set_reference_flat,
)
from hotswap.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Config,
    dequantize_blockwise,
    expand_scales,
    quantize_blockwise,
)

SCALE_NAME = "weight_scale_inv"
# As the bf16 GEMV (model/layers.py MATVEC_MAX_ROWS): the rows the kernel streams the
# weights once for.
FP8_MATVEC_MAX_ROWS = 8


@dataclass
class Fp8Layout:
    """Where a quantized layer's scales lie: `scale_rows[n]` is output row n's scale row;
    `shards[i]` the (first, count) scale rows of the layer's i-th checkpoint tensor."""

    block: tuple[int, int]
    scale_rows: torch.Tensor  # int32 [out_features]
    shards: list[tuple[int, int]]
    kernels: LayerKernels | None = field(default=None, repr=False)  # set with the model's
    # Fp8Config.keep_reference: the weight in the model dtype as received, laid out as the
    # codes (same shape and strides; not a parameter). None without it.
    reference: torch.Tensor | None = field(default=None, repr=False)
    serving: bool = False  # inside serving_reference: products over `reference`
    # Regions of the codes written as sent (no tensor in the model dtype came), whose
    # reference is re-derived as codes x scales once the scales are in: at the commit
    # (model/reference.py refresh_references).
    stale: list[Region] = field(default_factory=list, repr=False)

    @classmethod
    def for_shards(
        cls, sizes: list[int], block: tuple[int, int], device: torch.device
    ) -> Fp8Layout:
        rows, shards, first = [], [], 0
        for size in sizes:
            count = -(-size // block[0])
            rows.append(first + torch.arange(size) // block[0])
            shards.append((first, count))
            first += count
        scale_rows = torch.cat(rows).to(torch.int32).to(device)
        return cls(block, scale_rows, shards)

    @property
    def num_scale_rows(self) -> int:
        first, count = self.shards[-1]
        return first + count

    def scale_view(self, scale: torch.Tensor, shard: int | None) -> torch.Tensor:
        """The scale rows of checkpoint tensor `shard` (None: the layer's only one)."""
        first, count = self.shards[shard or 0]
        return scale.narrow(0, first, count)

    def dequantize(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The weight's values in `dtype` (float32 products rounded once, on any device).
        `rows`: the scale row of each of `codes`' rows, for some rows of the layer's
        (default: all of them, `scale_rows`)."""
        rows = self.scale_rows if rows is None else rows
        kernels = self.kernels
        if kernels is not None and kernels.fp8_dequantize is not None:
            return kernels.fp8_dequantize(codes, scale, rows, self.block[1], dtype)
        per_row = scale.index_select(0, rows)
        full = per_row.repeat_interleave(self.block[1], dim=1)[:, : codes.shape[1]]
        return (codes.float() * full).to(dtype)


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    layout: Fp8Layout,
    bias: torch.Tensor | None,
    invariant_linear: object = None,
    matvec_rows: int = FP8_MATVEC_MAX_ROWS,
) -> torch.Tensor:
    """x @ dequantized(codes)^T (+ bias). `invariant_linear`: batch-invariant mode's
    fixed-tile product (model/layers.py tiled_linear), over the dequantized weight.
    `matvec_rows`: up to this many rows through the CPU GEMV."""
    op = None if invariant_linear is not None else _kernel_for(layout.kernels, x, matvec_rows)
    if op is not None:
        out = op(x, codes, scale, layout.scale_rows, layout.block[1])
        return out if bias is None else out + bias
    weight = layout.dequantize(codes, scale, x.dtype)
    if invariant_linear is not None:
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _kernel_for(kernels: LayerKernels | None, x: torch.Tensor, matvec_rows: int):  # noqa: ANN202 - an op
    """The kernel that serves `x`'s rows against FP8 codes, if one does: a GEMM for any
    rows (the Triton one on CUDA), else the CPU GEMV for up to `matvec_rows`."""
    if kernels is None:
        return None
    if kernels.fp8_gemm is not None:
        return kernels.fp8_gemm
    if kernels.fp8_gemv is None or x.shape[0] > matvec_rows:
        return None
    return kernels.fp8_gemv


def quantize_linear(module: nn.Module, shard_sizes: list[int], config: Fp8Config) -> None:
    """Give linear layer `module` FP8 storage (before its weights are loaded): codes in
    `weight`, scales in `weight_scale_inv`, its layout in `module.fp8`."""
    out_features, in_features = module.weight.shape
    device = module.weight.device
    layout = Fp8Layout.for_shards(shard_sizes, config.block, device)
    if len(layout.scale_rows) != out_features:
        raise ValueError(f"quantization: shard sizes {shard_sizes} do not add up to {out_features}")
    scale_cols = -(-in_features // config.block[1])
    module.weight = nn.Parameter(
        torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), False
    )
    module.weight_scale_inv = nn.Parameter(
        torch.ones(layout.num_scale_rows, scale_cols, dtype=torch.float32, device=device), False
    )
    if config.keep_reference:
        layout.reference = torch.empty_like(module.weight, dtype=module.compute_dtype)
    module.fp8 = layout


class Fp8Stack:
    """FP8 storage of a mixture of experts' stacked parameter (`gate_up_proj` or
    `down_proj`), read as a linear layer's is: `weight` the codes [experts, rows, columns],
    `weight_scale_inv` the scales [experts, scale rows, scale columns], `fp8` the layout of
    one expert's matrix (every expert's is alike: its rows, gate and up ones included, are
    whole blocks, vLLM's rule for FP8 experts)."""

    def __init__(self, owner: nn.Module, name: str, config: Fp8Config) -> None:
        experts, rows, columns = getattr(owner, name).shape
        device = getattr(owner, name).device
        self.weight = nn.Parameter(
            torch.empty(experts, rows, columns, dtype=FP8_DTYPE, device=device), False
        )
        self.fp8 = Fp8Layout.for_shards([rows], config.block, device)
        self.fp8.kernels = owner.kernels  # FusedExperts hands later ones to its stacks too
        scale_cols = -(-columns // config.block[1])
        self.weight_scale_inv = nn.Parameter(torch.ones(
            experts, self.fp8.num_scale_rows, scale_cols, dtype=torch.float32, device=device
        ), False)  # fmt: skip
        if config.keep_reference:
            self.fp8.reference = torch.empty_like(self.weight, dtype=owner.compute_dtype)
        setattr(owner, name, self.weight)
        setattr(owner, scale_name_of(name), self.weight_scale_inv)

    def linear(self, x: torch.Tensor, expert: int, invariant_linear: object,
               matvec_rows: int) -> torch.Tensor:  # fmt: skip
        """x @ expert `expert`'s dequantized matrix^T (as fp8_linear)."""
        codes, scales = self.weight[expert], self.weight_scale_inv[expert]
        return fp8_linear(x, codes, scales, self.fp8, None, invariant_linear, matvec_rows)


def receipt_refusal(
    name: str, sent: torch.dtype, dest: torch.dtype, checkpoint: bool
) -> tuple[str, str] | None:
    """Why a round may not send tensor `name` (of dtype `sent`) to a destination of dtype
    `dest` in a quantized model, as (the meta at fault: name or dtype, why); None if it may.
    A round sends checkpoint tensors: bf16/float32 ones, which the engine quantizes on
    receipt, or an FP8 weight's codes with its float32 `weight_scale_inv` as a trainer
    quantized them (slime's, AReaL's and verl's way to SGLang; both must come in one round:
    `unpaired_fp8`)."""
    scale = codes_of_scale(name) is not None
    if dest != FP8_DTYPE and not scale:
        if sent == FP8_DTYPE:
            return "dtype", f"weights: {name!r} is not an FP8 weight here; send it as {dest}"
        return None
    if not checkpoint:
        return "name", (
            f"weights: {name!r} is an FP8 weight; send it in checkpoint format "
            f"(is_checkpoint_format=true), whose bf16/float32 tensors are quantized on receipt"
        )
    if scale and sent != torch.float32:
        return "dtype", f"weights: {name!r}: FP8 scales are float32, sent {sent}"
    return None


def quantized_send_refusal(
    name: str, sent: torch.dtype, sparse: bool, sliced: bool
) -> tuple[str, str] | None:
    """Why FP8 codes or scales a trainer quantized (`name`, `sent`) may not go where they
    are sent: into a sparse delta, or to ranks that each hold a share of every tensor
    (tensor parallelism: the trainer's blocks need not fall on a rank's share). None if
    they may, or if they are neither."""
    if not (sparse or sliced) or (sent != FP8_DTYPE and codes_of_scale(name) is None):
        return None
    why = "a sparse delta" if sparse else "tensor-parallel ranks (each quantizes its share)"
    return "dtype" if sent == FP8_DTYPE else "name", (
        f"weights: {name!r}: FP8 codes and scales cannot be sent to {why}; send the "
        f"bf16/float32 weight, which the engine quantizes on receipt"
    )


def codes_of_scale(name: str) -> str | None:
    """The FP8 codes checkpoint tensor `name` holds the scales of (the inverse of
    scale_name_of), or None if it is no scale tensor."""
    return name.removesuffix("_scale_inv") if name.endswith("_scale_inv") else None


def unpaired_fp8(codes: set[str], scales: set[str]) -> str | None:
    """Why a round's trainer-quantized tensors do not pair up (`codes`: names sent as FP8
    codes; `scales`: scale names sent), or None: codes without their scales cannot be
    served, and scales alone would overwrite those of a weight quantized on receipt."""
    for name in sorted(codes):
        if scale_name_of(name) not in scales:
            return (f"weights: {name!r} was sent as FP8 codes without its scales "
                    f"{scale_name_of(name)!r}; nothing was applied")  # fmt: skip
    for name in sorted(scales):
        if codes_of_scale(name) not in codes:
            return (f"weights: {name!r} was sent without {codes_of_scale(name)!r} as FP8 "
                    f"codes (scales come with their codes); nothing was applied")  # fmt: skip
    return None


def scale_name_of(param_name: str) -> str:
    """The scale parameter of FP8 codes `param_name`: a linear layer's `weight` ->
    `weight_scale_inv`; stacked experts' `gate_up_proj` -> `gate_up_proj_scale_inv`
    (transformers' names for FP8 experts)."""
    if param_name.endswith(".weight"):
        return param_name[: -len("weight")] + SCALE_NAME
    return f"{param_name}_scale_inv"


def scale_view_for(module: nn.Module, codes_view: torch.Tensor) -> torch.Tensor:
    """The scale rows of `codes_view`, as FP8 layer `module`'s `weight` holds them: a
    range of whole rows of a 2-D weight or of one expert's matrix (a checkpoint tensor's,
    or this rank's share of one), or a 3-D stack of experts' matrices (all their rows or
    one range of rows of each), whose scales are then [experts, scale rows, columns]."""
    param = module.weight.data
    layout: Fp8Layout = module.fp8
    scales = module.weight_scale_inv.data
    offset = codes_view.storage_offset() - param.storage_offset()
    count = -(-codes_view.shape[-2] // layout.block[0])
    if param.dim() == 2:
        return scales.narrow(0, int(layout.scale_rows[offset // param.shape[1]]), count)
    # stacked experts: `layout` is one expert's matrix's (every expert's alike)
    expert, offset = divmod(offset, param.stride(0))
    first = int(layout.scale_rows[offset // param.shape[-1]])
    if codes_view.dim() == 3:
        return scales[expert : expert + codes_view.shape[0]].narrow(1, first, count)
    return scales[expert].narrow(0, first, count)


@torch.no_grad()
def quantize_into(
    layout: Fp8Layout, codes_view: torch.Tensor, scale_view: torch.Tensor, tensor: torch.Tensor
) -> None:
    """A checkpoint tensor's part (bf16/float32) quantized into its codes and scales; a
    3-D part (stacked experts) one expert's matrix at a time, as a checkpoint that names
    each expert's projections quantizes them."""
    if codes_view.dim() == 3:
        for codes, scales, part in zip(codes_view, scale_view, tensor, strict=True):
            quantize_into(layout, codes, scales, part)
        return
    codes, scales = quantize_blockwise(tensor.to(codes_view.device), layout.block)
    codes_view.copy_(codes)
    scale_view.copy_(scales)


@torch.no_grad()
def requantize_delta(
    layout: Fp8Layout,
    codes_view: torch.Tensor,
    scale_view: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """A sparse delta (flat `indices` of `codes_view` set to `values`) into FP8 codes: the
    blocks it touches are dequantized, written and quantized again; the others keep their
    codes and scales, so the result is what loading the dequantized weight with the delta
    applied gives. It costs a dequantization and quantization of the tensor's part (of
    each expert's matrix the delta touches, for a 3-D stack of experts)."""
    if codes_view.dim() == 3:
        per_expert = codes_view[0].numel()
        experts = indices // per_expert
        for e in torch.unique(experts).tolist():
            mine = experts == e
            local, part = indices[mine] - e * per_expert, values[mine.to(values.device)]
            requantize_delta(layout, codes_view[e], scale_view[e], local, part)
        return
    dense = dequantize_blockwise(codes_view, scale_view, layout.block, torch.float32)
    dense.view(-1)[indices] = values.to(dense.device, torch.float32)
    codes, scales = quantize_blockwise(dense, layout.block)
    touched = torch.zeros(scales.shape, dtype=torch.bool, device=scales.device)
    columns = codes_view.shape[1]
    touched[indices // columns // layout.block[0], indices % columns // layout.block[1]] = True
    rewrite = expand_scales(touched, tuple(codes_view.shape), layout.block)
    code_bytes = codes_view.view(torch.uint8)
    code_bytes.copy_(torch.where(rewrite, codes.view(torch.uint8), code_bytes))
    scale_view.copy_(torch.where(touched, scales, scale_view))


def _fp8_layer(model: nn.Module, name: str) -> nn.Module | None:
    """The FP8 layer checkpoint tensor `name` is written to (None: not an FP8 weight, or
    a model without FP8 layers, such as an adapter's stage)."""
    find = getattr(model, "checkpoint_fp8_layer", None)
    return None if find is None else find(name)


def write_part(model: nn.Module, name: str, view: torch.Tensor, tensor: torch.Tensor) -> None:
    """Checkpoint tensor `name`'s part `tensor` into `view` (its `checkpoint_view`, or this
    rank's part of it); quantized on the way into an FP8 weight."""
    layer = _fp8_layer(model, name)
    if layer is None or tensor.dtype == FP8_DTYPE:  # FP8 codes a trainer quantized: as sent
        view.copy_(tensor)
        if layer is not None:
            note_codes_as_sent(layer, view)
    else:
        quantize_into(layer.fp8, view, scale_view_for(layer, view), tensor)
        set_reference(reference_view(layer, view), tensor)


def write_flat(
    model: nn.Module, name: str, view: torch.Tensor, indices: torch.Tensor, values: torch.Tensor
) -> None:
    """Set flat `indices` of checkpoint tensor `name`'s `view` (this rank's share) to
    `values` (a sparse delta); into an FP8 weight through `requantize_delta`."""
    layer = _fp8_layer(model, name)
    if layer is None:
        view.view(-1)[indices] = values.to(view.dtype)
    else:
        requantize_delta(layer.fp8, view, scale_view_for(layer, view), indices, values)
        set_reference_flat(reference_view(layer, view), indices, values)
