"""The FP8 KV cache (--kv-cache-dtype fp8), with vLLM's semantics: the cache holds float8
e4m3fn codes; each layer has one float32 scale for its keys and one for its values
(`k_scale`, `v_scale`: a checkpoint's, else 1.0). A write stores value / scale, saturated
to +-448 and rounded to nearest even (torch's cast); a read is code x scale, rounded to
the attention's dtype (as vLLM's Triton kernels do). Every backend reads and writes
through these definitions or kernels that compute the same values.

Scales are host floats fixed when the engine starts: a captured CUDA graph or compiled
step keeps them as constants, and a weight round does not carry them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # e4m3fn's largest finite value

# A checkpoint's per-layer scales, in the spellings vLLM reads (its maybe_remap_kv_scale_name):
# `...self_attn.k_scale`, `...self_attn.attn.k_scale`, `...self_attn.k_proj.k_scale`, the
# older `...self_attn.k_proj.output_scale`, and `...self_attn.kv_scale` (both keys and values).
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.|[kv]_proj\.)?"
    r"(k_scale|v_scale|kv_scale|(?:k|v)_proj\.output_scale)$"
)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 codes of x / scale, saturated (computed in float32, as vLLM's kernels do)."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """codes x scale in `dtype` (every e4m3 value is exact in bf16 and float32, so the only
    rounding is the product's, in float32 arithmetic)."""
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
