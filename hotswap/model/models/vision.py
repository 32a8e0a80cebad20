"""The Qwen2.5-VL vision tower: pixels of several images (or video frames) in, one embedding
per merged patch (merge x merge neighbouring patches) out, ready to replace the image tokens
in the language model's input.

Layout of the patch sequence. The image processor gives an image's patches in merge-block
order: the merged units row-major over the (h/merge, w/merge) grid, and inside a unit its
merge x merge patches row-major. The tower then reorders the units window by window (each
window a square of `window_size // patch_size // merge` units, cut short at the right and
bottom edges), so that a windowed-attention segment is a contiguous run of rows; the full-
attention blocks see each frame as one segment. The merger folds each unit's merge**2
consecutive rows into one, and the inverse window permutation puts the merged rows back in
the image's own unit order, image after image.
"""

from __future__ import annotations

from collections.abc import Sequence
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

# HF's Qwen2.5-VL RMSNorms (blocks and merger) all use this epsilon; it is not in config.json.
_RMS_EPS = 1e-6


@dataclass(frozen=True)
class VisionSpec(TowerSpec):
    """Qwen2.5-VL's tower: windows of `window_size` pixels, full attention in some blocks."""

    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)

    @property
    def window_units(self) -> int:
        """Merged units per window side."""
        return self.window_size // self.patch_size // self.spatial_merge_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionSpec:
        """From the `vision_config` dict of a Qwen2.5-VL config.json."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: vision_config.hidden_act {act!r} is not supported")
        d = cls()
        spec = cls(
            **cls.shared_fields(cfg),
            window_size=int(cfg.get("window_size", d.window_size)),
            fullatt_block_indexes=tuple(
                int(i) for i in cfg.get("fullatt_block_indexes", d.fullatt_block_indexes)
            ),
        )
        spec.check_heads()
        if spec.window_units < 1:
            raise ValueError(
                f"config.json: vision_config.window_size ({spec.window_size}) is smaller than "
                "patch_size * spatial_merge_size"
            )
        return spec


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # As HF: normalise in float32, round to the input's dtype, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _RMS_EPS)
        return self.weight * xf.to(x.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        t, p = spec.temporal_patch_size, spec.patch_size
        # Stored as the checkpoint's Conv3d weight; its stride equals its kernel, so on one
        # patch it is a dot product over the patch flattened as (C, T, P, P), the same order
        # as a row of pixel_values.
        shape = (spec.hidden_size, spec.in_channels, t, p, p)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def forward(self, pixels: Tensor) -> Tensor:
        w = self.proj.weight
        return pixels.to(w.dtype) @ w.reshape(w.shape[0], -1).t()


class _MLP(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = FrozenLinear(spec.hidden_size, spec.intermediate_size, dtype)
        self.up_proj = FrozenLinear(spec.hidden_size, spec.intermediate_size, dtype)
        self.down_proj = FrozenLinear(spec.intermediate_size, spec.hidden_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Merger(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        wide = spec.hidden_size * spec.merge_unit
        self.ln_q = _RMSNorm(spec.hidden_size, dtype)
        # Indexed 0 and 2 as the checkpoint's nn.Sequential(Linear, GELU, Linear).
        self.mlp = nn.Sequential(
            FrozenLinear(wide, wide, dtype),
            nn.GELU(),
            FrozenLinear(wide, spec.out_hidden_size, dtype),
        )
        self.wide = wide

    def forward(self, x: Tensor) -> Tensor:
        # Rows come in runs of merge**2 per unit (the window order moves whole units).
        return self.mlp(self.ln_q(x).reshape(-1, self.wide))


def _window_order(t: int, h: int, w: int, win: int) -> tuple[Tensor, list[int]]:
    """The units (of a t x h x w unit grid) in window order, and the units per window.
    Windows are win x win units, row-major per frame; the last row/column of windows is
    cut at the grid's edge, so no window is empty."""
    nh, nw = -(-h // win), -(-w // win)
    grid = torch.arange(t * h * w).view(t, h, w)
    padded = F.pad(grid, (0, nw * win - w, 0, nh * win - h), value=-1)
    windows = padded.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(-1, win * win)
    valid = windows >= 0
    return windows[valid], valid.sum(1).tolist()


@dataclass
class _Layout:
    """Everything forward needs that depends only on the grids."""

    patch_order: Tensor  # [num_patches]: window-ordered row -> input row
    unit_order: Tensor  # [num_units]: window-ordered unit -> unit index in the input
    positions: Tensor  # [num_patches, 2]: (row, col) per window-ordered row
    window_groups: list[Tensor]
    full_groups: list[Tensor]


def _layout(spec: VisionSpec, grids: Sequence[Grid], device: torch.device) -> _Layout:
    m, mu = spec.spatial_merge_size, spec.merge_unit
    units, window_lens, frame_lens, positions = [], [], [], []
    base = 0
    for t, h, w in grids:
        order, lens = _window_order(t, h // m, w // m, spec.window_units)
        units.append(order + base)
        base += t * (h // m) * (w // m)
        window_lens += [n * mu for n in lens]
        frame_lens += [h * w] * t  # full attention: each frame on its own
        positions.append(merge_block_positions(t, h, w, m))
    unit_order = torch.cat(units)
    # A unit's merge**2 patches are consecutive rows, and stay so after the reorder.
    patch_order = (unit_order.view(-1, 1) * mu + torch.arange(mu)).view(-1)
    return _Layout(
        patch_order=patch_order.to(device),
        unit_order=unit_order.to(device),
        positions=torch.cat(positions)[patch_order].to(device),
        window_groups=length_groups(window_lens, device),
        full_groups=length_groups(frame_lens, device),
    )


class Qwen2_5VisionTower(VisionTower):
    """Qwen2.5-VL's `visual` module; parameter names are the checkpoint's after `visual.`."""

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec = VisionSpec.from_hf(vision_config)
        self.dtype = dtype
        self.patch_embed = _PatchEmbed(spec, dtype)
        self.blocks = nn.ModuleList(
            [VisionBlock(spec, dtype, _RMSNorm, _MLP(spec, dtype)) for _ in range(spec.depth)]
        )
        self.merger = _Merger(spec, dtype)
        self.rotary = AxialRotary(spec.head_dim, spec.rope_theta)

    def forward(self, pixel_values: Tensor, grid_thw: Sequence[Grid]) -> Tensor:
        """pixel_values [num_patches, C*T*P*P] (images' patches one after the other, each in
        merge-block order), grid_thw the (t, h, w) patch grid of each image -> embeddings
        [num_patches // merge**2, out_hidden_size] in self.dtype, image after image."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        self._check_input(pixel_values, grids)
        if not grids:
            return pixel_values.new_empty((0, self.spec.out_hidden_size), dtype=self.dtype)
        lay = _layout(self.spec, grids, pixel_values.device)
        x = self.patch_embed(pixel_values[lay.patch_order])
        cos, sin = self.rotary(lay.positions)
        full = set(self.spec.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            groups = lay.full_groups if i in full else lay.window_groups
            x = block(x, cos, sin, groups)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[lay.unit_order] = merged  # undo the window order
        return out
