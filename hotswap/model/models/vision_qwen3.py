"""The Qwen3-VL vision tower: pixels of several images (or video frames) in; out, one embedding
per merged unit (merge x merge neighbouring patches) for the language model's image tokens,
plus the DeepStack features: one more embedding per unit from each of a few intermediate
blocks, which the language model adds to its hidden states in its first layers.

Against Qwen2.5-VL's tower: LayerNorm (with bias) instead of RMSNorm, a two-layer GELU MLP,
every block attends over a whole frame (no windows, so the patches stay in the processor's
merge-block order throughout), a learned position table bilinearly resampled to each grid and
added after the patch embedding, and the DeepStack mergers, which normalise the merge x merge
patches of a unit as one wide vector (after the spatial shuffle) rather than patch by patch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hotswap.model.models.vision_base import (
    AxialRotary,
    FrozenLinear,
    Grid,
    TowerSpec,
    VisionBlock,
    VisionTower,
    length_groups,
    merge_block_positions,
)

# Every LayerNorm of HF's Qwen3-VL tower (blocks and mergers) uses this; not in config.json.
_LN_EPS = 1e-6

# config.json's vision_config.hidden_act -> the blocks' MLP activation (HF's ACT2FN meaning).
# The mergers always use the exact (erf) GELU, whatever hidden_act says.
_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class Qwen3VisionSpec(TowerSpec):
    """What config.json's `vision_config` says about the tower, with HF's defaults."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    patch_size: int = 16
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def pos_grid_side(self) -> int:
        """Side of the square grid the learned position table covers."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3VisionSpec:
        """From the `vision_config` dict of a Qwen3-VL config.json."""
        d = cls()
        spec = cls(
            **cls.shared_fields(cfg),
            num_position_embeddings=int(
                cfg.get("num_position_embeddings", d.num_position_embeddings)
            ),
            deepstack_visual_indexes=tuple(
                int(i) for i in cfg.get("deepstack_visual_indexes", d.deepstack_visual_indexes)
            ),
            hidden_act=str(cfg.get("hidden_act", d.hidden_act)),
        )
        spec._check()
        return spec

    def _check(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"config.json: vision_config.hidden_act {self.hidden_act!r} is not supported "
                f"(supported: {', '.join(sorted(_ACTIVATIONS))})"
            )
        self.check_heads()
        side = self.pos_grid_side
        if side < 1 or side * side != self.num_position_embeddings:
            raise ValueError(
                "config.json: vision_config.num_position_embeddings "
                f"({self.num_position_embeddings}) must be a positive perfect square"
            )
        ds = self.deepstack_visual_indexes
        if len(set(ds)) != len(ds) or any(not 0 <= i < self.depth for i in ds):
            raise ValueError(
                f"config.json: vision_config.deepstack_visual_indexes {list(ds)} must be "
                f"distinct block indexes below vision_config.depth ({self.depth})"
            )


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Filled by load_weights; never trained here.
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.bias = _param(dim, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, _LN_EPS)


class _PatchEmbed(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        t, p = spec.temporal_patch_size, spec.patch_size
        # Stored as the checkpoint's Conv3d; its stride equals its kernel, so on one patch it
        # is a dot product over the patch flattened as (C, T, P, P), a row of pixel_values.
        self.proj = nn.Module()
        self.proj.weight = _param(spec.hidden_size, spec.in_channels, t, p, p, dtype=dtype)
        self.proj.bias = _param(spec.hidden_size, dtype=dtype)

    def forward(self, pixels: Tensor) -> Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _MLP(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = FrozenLinear(spec.hidden_size, spec.intermediate_size, dtype)
        self.linear_fc2 = FrozenLinear(spec.intermediate_size, spec.hidden_size, dtype)
        self.act = _ACTIVATIONS[spec.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Merger(nn.Module):
    """merge**2 consecutive patch rows (one unit, in merge-block order) -> one output row."""

    def __init__(self, spec: Qwen3VisionSpec, dtype: torch.dtype, postshuffle: bool) -> None:
        super().__init__()
        self.wide = spec.hidden_size * spec.merge_unit
        # The final merger normalises each patch (hidden_size); the DeepStack ones the
        # concatenated unit (hidden_size * merge**2), after the shuffle.
        self.postshuffle = postshuffle
        self.norm = _LayerNorm(self.wide if postshuffle else spec.hidden_size, dtype)
        self.linear_fc1 = FrozenLinear(self.wide, self.wide, dtype)
        self.linear_fc2 = FrozenLinear(self.wide, spec.out_hidden_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.postshuffle:
            x = self.norm(x.reshape(-1, self.wide))
        else:
            x = self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _axis_taps(n: int, side: int) -> tuple[Tensor, Tensor, Tensor]:
    """Bilinear resampling (align_corners) of a `side`-long axis to `n` points: for each
    point, the lower and upper source index and the upper one's weight, in float32."""
    # Point i sits at i * (side - 1) / (n - 1) in source coordinates: both ends line up.
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    lo = src.floor()
    frac = src - lo
    hi = (lo + 1).clamp(max=side - 1)  # at the last point frac is 0, so the clamp is harmless
    return lo.long(), hi.long(), frac


def _pos_taps(h: int, w: int, m: int, side: int) -> tuple[Tensor, Tensor]:
    """For one frame's patches in merge-block order: the 4 table rows each patch blends and
    their weights, both [h*w, 4]; the taps as (top-left, top-right, bottom-left, bottom-right)."""
    pos = merge_block_positions(1, h, w, m)
    r_lo, r_hi, r_f = (a[pos[:, 0]] for a in _axis_taps(h, side))
    c_lo, c_hi, c_f = (a[pos[:, 1]] for a in _axis_taps(w, side))
    index = torch.stack(
        [r_lo * side + c_lo, r_lo * side + c_hi, r_hi * side + c_lo, r_hi * side + c_hi], dim=1
    )
    weight = torch.stack(
        [(1 - r_f) * (1 - c_f), (1 - r_f) * c_f, r_f * (1 - c_f), r_f * c_f], dim=1
    )
    return index, weight


@dataclass
class _Layout:
    """Everything forward needs that depends only on the grids; rows in input order."""

    positions: Tensor  # [num_patches, 2]: (row, col) of each patch in its frame
    pos_index: Tensor  # [num_patches, 4]: position-table rows blended into each patch
    pos_weight: Tensor  # [num_patches, 4] float32: their weights
    frame_groups: list[Tensor]  # attention segments: one per frame


def _layout(spec: Qwen3VisionSpec, grids: Sequence[Grid], device: torch.device) -> _Layout:
    m, side = spec.spatial_merge_size, spec.pos_grid_side
    positions, indexes, weights, frame_lens = [], [], [], []
    for t, h, w in grids:
        positions.append(merge_block_positions(t, h, w, m))
        # Every frame of an image gets the same position embedding.
        index, weight = _pos_taps(h, w, m, side)
        indexes.append(index.repeat(t, 1))
        weights.append(weight.repeat(t, 1))
        frame_lens += [h * w] * t
    return _Layout(
        positions=torch.cat(positions).to(device),
        pos_index=torch.cat(indexes).to(device),
        pos_weight=torch.cat(weights).to(device),
        frame_groups=length_groups(frame_lens, device),
    )


class Qwen3VisionTower(VisionTower):
    """Qwen3-VL's `visual` module; parameter names are the checkpoint's after `visual.`."""

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec = Qwen3VisionSpec.from_hf(vision_config)
        self.dtype = dtype
        self.patch_embed = _PatchEmbed(spec, dtype)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = _param(spec.num_position_embeddings, spec.hidden_size, dtype=dtype)
        self.blocks = nn.ModuleList(
            [VisionBlock(spec, dtype, _LayerNorm, _MLP(spec, dtype)) for _ in range(spec.depth)]
        )
        self.merger = _Merger(spec, dtype, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [_Merger(spec, dtype, postshuffle=True) for _ in spec.deepstack_visual_indexes]
        )
        self.rotary = AxialRotary(spec.head_dim, spec.rope_theta)

    def _position_embedding(self, lay: _Layout) -> Tensor:
        # As HF: gather the table rows, blend them with float32 weights, sum in float32.
        taps = F.embedding(lay.pos_index, self.pos_embed.weight)  # [N, 4, hidden]
        return (taps * lay.pos_weight[:, :, None]).sum(1)

    def forward(
        self, pixel_values: Tensor, grid_thw: Sequence[Grid]
    ) -> tuple[Tensor, list[Tensor]]:
        """pixel_values [num_patches, C*T*P*P] (images' patches one after the other, each in
        merge-block order), grid_thw the (t, h, w) patch grid of each image -> (embeddings
        [num_patches // merge**2, out_hidden_size], the DeepStack features: one tensor of that
        shape per deepstack_visual_indexes entry, in block order), in self.dtype, rows image
        after image."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        self._check_input(pixel_values, grids)
        if not grids:
            empty = pixel_values.new_empty((0, self.spec.out_hidden_size), dtype=self.dtype)
            return empty, [empty.clone() for _ in self.deepstack_merger_list]
        lay = _layout(self.spec, grids, pixel_values.device)
        x = self.patch_embed(pixel_values)
        x = x + self._position_embedding(lay).to(x.dtype)
        cos, sin = self.rotary(lay.positions)
        merger_of = {b: k for k, b in enumerate(self.spec.deepstack_visual_indexes)}
        deepstack: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lay.frame_groups)
            if i in merger_of:
                deepstack.append(self.deepstack_merger_list[merger_of[i]](x))
        return self.merger(x), deepstack
