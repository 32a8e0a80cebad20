"""The FP8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3, fp8_e5m2), with vLLM's semantics: the
cache holds float8 e4m3fn or e5m2 codes; each layer has one float32 scale for its keys and
one for its values (`k_scale`, `v_scale`: a checkpoint's, else 1.0, for either format, as
vLLM loads them; or, with --calculate-kv-scales, computed from the first step's K/V). A
write stores value / scale, saturated to the format's largest finite value (448 for e4m3,
57344 for e5m2) and rounded to nearest even (torch's cast: vLLM's CUDA and Triton kernels
round so; its CPU kernels truncate toward zero instead); a read is code x scale, rounded
to the attention's dtype (as vLLM's Triton kernels do). Every backend reads and writes
through these definitions or kernels that compute the same values.

Scales are host floats fixed before the first real step: a captured CUDA graph or compiled
step keeps them as constants, and a weight round does not carry or recompute them (vLLM
computes --calculate-kv-scales once and keeps it across weight reloads too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from hotswap.config import FP8_KV_DTYPES

FP8_KV_DTYPE = FP8_KV_DTYPES["fp8_e4m3"]  # vLLM's "fp8"
# vLLM's --calculate-kv-scales divisors (its K_SCALE_CONSTANT and V_SCALE_CONSTANT defaults):
# k_scale = max|K| / 200, v_scale = max|V| / 100 over the first step's keys and values.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

# A checkpoint's per-layer scales, in the spellings vLLM reads (its maybe_remap_kv_scale_name):
# `...self_attn.k_scale`, `...self_attn.attn.k_scale`, `...self_attn.k_proj.k_scale`, the
# older `...self_attn.k_proj.output_scale`, and `...self_attn.kv_scale` (both keys and values).
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.|[kv]_proj\.)?"
    r"(k_scale|v_scale|kv_scale|(?:k|v)_proj\.output_scale)$"
)


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES.values()


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`dtype` codes (an FP8_KV_DTYPES value) of x / scale, computed in float32 as vLLM's
    kernels do, saturated to the format's largest finite value before the cast (torch's
    cast to e5m2 would give infinities past it; vLLM's kernels saturate)."""
    bound = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-bound, bound).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """codes x scale in `dtype` (every e4m3 and e5m2 value is exact in bf16, float16 and
    float32, so the only rounding is the product's, in float32 arithmetic)."""
    if scale == 1.0:
        return codes.to(dtype)
    return codes.to(torch.float32).mul_(scale).to(dtype)


def split_kv_scales(
    items: Iterator[tuple[str, torch.Tensor]], found: dict[int, dict[str, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its KV scales, which go into `found` (layer ->
    {"k": scale, "v": scale}) as they pass."""
    for name, tensor in items:
        match = _SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        layer, kind = int(match.group(1)), match.group(2)
        value = float(tensor.float().max())  # a per-tensor scale (one element; max if more)
        if kind == "kv_scale":
            found.setdefault(layer, {}).update(k=value, v=value)
        else:
            found.setdefault(layer, {})[kind[0]] = value


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def set_checkpoint_kv_scales(model: nn.Module, found: dict[int, dict[str, float]]) -> None:
    """Record the checkpoint's scales on the attention layers (1.0 where absent); all
    checked first, so a bad one changes nothing."""
    layers = attention_layers(model)
    for index, scales in found.items():
        for kind, value in scales.items():
            if index >= len(layers) or not 0 < value < float("inf"):
                raise ValueError(
                    f"weights: layer {index}'s {kind}_scale ({value}) is not a positive "
                    f"finite scale of one of {len(layers)} layers"
                )
    for index, attn in enumerate(layers):
        scales = found.get(index, {})
        attn.k_scale, attn.v_scale = scales.get("k", 1.0), scales.get("v", 1.0)


def use_fp8_kv(model: nn.Module, fp8: bool) -> None:
    """Have every attention layer quantize its K/V with its scales (fp8), or not."""
    for attn in attention_layers(model):
        attn.kv_scales = (attn.k_scale, attn.v_scale) if fp8 else None


def first_step_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """vLLM's calc_kv_scales: max|K| / 200 and max|V| / 100 over a step's keys and values
    (post-RoPE), the max taken in the model's dtype and divided in float32, as vLLM does.
    A max is exact and independent of order: the same batch gives the same scales. Where a
    max is 0 (or not finite) the scale stays 1.0: vLLM would divide by 0 and fill the cache
    with NaNs."""
    scales = []
    for x, constant in ((key, K_SCALE_CONSTANT), (value, V_SCALE_CONSTANT)):
        scale = float(x.abs().amax().float() / constant)
        scales.append(scale if 0 < scale < float("inf") else 1.0)
    return scales[0], scales[1]


def take_first_step_scales(attn: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
    """--calculate-kv-scales: the layer's scales from this step's K/V, before any of them is
    written to the cache; then kept for the engine's life (weight rounds included)."""
    attn.k_scale, attn.v_scale = first_step_scales(key, value)
    if attn.kv_scales is not None:
        attn.kv_scales = (attn.k_scale, attn.v_scale)
    attn.calculate_kv_scales = False


def calculate_kv_scales_on_first_step(model: nn.Module) -> None:
    """Have every attention layer take its scales from the next forward (the engine's first
    real step: armed after the compile warm-up's dummy steps, which must not count)."""
    for attn in attention_layers(model):
        attn.calculate_kv_scales = True
