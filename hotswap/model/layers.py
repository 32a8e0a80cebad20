"""Building blocks shared by the decoder models. Parameters are created uninitialised:
real values always come from `load_weights` or the dummy initialiser."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Batch-invariant mode runs every matmul on fixed-shape row tiles: CPU GEMM kernels pick
# their reduction order from the problem shape, so a row's result would otherwise depend on
# how many other rows share the batch. Measured: row results are then bitwise equal for
# any batch size and any row position within the tile.
INVARIANT_TILE_ROWS = 16


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    pad = (-rows) % INVARIANT_TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    tiles = [F.linear(tile, weight, bias) for tile in x.split(INVARIANT_TILE_ROWS)]
    return torch.cat(tiles)[:rows]


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None
        self.batch_invariant = batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return tiled_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the weight's dtype (the model dtype: exactly as
    HF Llama/Qwen do)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Rounded to the weight's dtype: the input's everywhere but a float32 final norm
        # ahead of a float32 LM head, whose input then stays unrounded.
        return self.weight * x32.to(self.weight.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in place in the gate half (no new activation-sized buffers)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed float32 cos/sin table indexed by position.
    One instance serves all layers: the step's cos/sin are looked up once."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """cos and sin for the step's positions, [tokens, 1, head_dim], in `dtype`
        (transformers casts them to the activation dtype the same way)."""
        cos = self.cos[positions].repeat(1, 2)[:, None, :].to(dtype)
        sin = self.sin[positions].repeat(1, 2)[:, None, :].to(dtype)
        return cos, sin


RopeTable = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """x: [tokens, heads, head_dim]."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config form: top-level `rope_theta` + `rope_scaling`
    (transformers 4.x) or a `rope_parameters` dict (transformers 5.x)."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported")
    return params


def rope_inv_freq(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponent)
    if rope["rope_type"] == "linear":
        return inv_freq / float(rope["factor"])
    if rope["rope_type"] == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
