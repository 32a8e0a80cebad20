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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hotswap.errors import InvalidArgument

# HF's Qwen2.5-VL RMSNorms (blocks and merger) all use this epsilon; it is not in config.json.
_RMS_EPS = 1e-6

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class TowerSpec:
    """What every Qwen vision tower's `vision_config` says, with HF's Qwen2.5-VL defaults
    (each tower's spec adds its own fields and defaults)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged unit (one output row)."""
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per patch in `pixel_values`: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def shared_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The shared keys of `cfg` (a config.json's vision_config), this spec's defaults
        where absent."""
        d = cls()
        rope = cfg.get("rope_parameters") or {}
        ints = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                "temporal_patch_size", "spatial_merge_size", "out_hidden_size")  # fmt: skip
        fields = {name: int(cfg.get(name, getattr(d, name))) for name in ints}
        # The released checkpoints' config.json say `in_chans`; HF's class `in_channels`.
        fields["in_channels"] = int(cfg.get("in_channels", cfg.get("in_chans", d.in_channels)))
        fields["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", d.rope_theta)))
        return fields

    def check_heads(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"config.json: vision_config.hidden_size ({self.hidden_size}) is not a "
                f"multiple of vision_config.num_heads ({self.num_heads})"
            )
        # The 2-D rotary splits the head in four: (h, w) x (cos/sin halves).
        if self.head_dim % 4:
            raise ValueError(
                f"config.json: vision head dim {self.head_dim} (vision_config.hidden_size / "
                "num_heads) must be a multiple of 4"
            )


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


class FrozenLinear(nn.Module):
    """A linear layer whose parameters come from a checkpoint (uninitialised, no grad)."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(n_out, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


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


class VisionAttention(nn.Module):
    """A tower block's attention (both Qwen towers'): qkv, the 2-D rotary, bidirectional
    attention within each segment of `groups`, the output projection."""

    def __init__(self, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = FrozenLinear(spec.hidden_size, 3 * spec.hidden_size, dtype)
        self.proj = FrozenLinear(spec.hidden_size, spec.hidden_size, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: list[Tensor]) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch.empty_like(q)
        # Each group holds segments of one length L (windows, or frames) as rows
        # [num_segments, L] of indices into the sequence: a batch of bidirectional
        # attentions with no mask.
        for idx in groups:
            qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]
            out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = FrozenLinear(spec.hidden_size, spec.intermediate_size, dtype)
        self.up_proj = FrozenLinear(spec.hidden_size, spec.intermediate_size, dtype)
        self.down_proj = FrozenLinear(spec.intermediate_size, spec.hidden_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, spec: VisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(spec.hidden_size, dtype)
        self.norm2 = _RMSNorm(spec.hidden_size, dtype)
        self.attn = VisionAttention(spec, dtype)
        self.mlp = _MLP(spec, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: list[Tensor]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


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


class AxialRotary(nn.Module):
    """Axial 2-D rotary: head_dim // 4 frequencies, shared by the row and the column axis."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        # Derived from the config, never in a checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(row, col) positions [N, 2] -> cos, sin [N, head_dim] in float32, laid out as
        (row angles, col angles) twice over, to pair with rotate-half."""
        angles = positions.float()[..., None] * self.inv_freq  # [N, 2, hd/4]
        angles = angles.flatten(1)  # [N, hd/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary on x [N, heads, hd] with cos/sin [N, hd], in float32 as HF, back in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def merge_block_positions(t: int, h: int, w: int, m: int) -> Tensor:
    """(row, col) of each patch of a frame in merge-block order, repeated for t frames:
    [t*h*w, 2]."""
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    # (unit row, unit col, in-unit row, in-unit col), flattened.
    pos = torch.stack([rows, cols], dim=-1).permute(0, 2, 1, 3, 4).reshape(-1, 2)
    return pos.repeat(t, 1)


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


def length_groups(lengths: Sequence[int], device: torch.device) -> list[Tensor]:
    """Contiguous segments of the given lengths, grouped by length: for each length L an
    index tensor [segments of length L, L] into the sequence."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for n in lengths:
        starts.setdefault(n, []).append(offset)
        offset += n
    return [
        (torch.tensor(s).view(-1, 1) + torch.arange(n).view(1, -1)).to(device)
        for n, s in starts.items()
    ]


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


class VisionTower(nn.Module):
    """What every Qwen vision tower shares: its input checks and loading by checkpoint
    name (`spec`: a TowerSpec, set by the subclass)."""

    spec: TowerSpec

    def _check_input(self, pixel_values: Tensor, grids: Sequence[Grid]) -> None:
        m = self.spec.spatial_merge_size
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % m or w % m:
                raise InvalidArgument(
                    "grid_thw", f"grid {(t, h, w)}: h and w must be positive multiples of {m}"
                )
        rows = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (rows, self.spec.patch_dim):
            raise InvalidArgument(
                "pixel_values",
                f"pixel_values has shape {tuple(pixel_values.shape)}, the grids need "
                f"{(rows, self.spec.patch_dim)}",
            )

    def expected_checkpoint_keys(self) -> set[str]:
        """The checkpoint tensors the tower needs, named relative to `visual.`."""
        return {name for name, _ in self.named_parameters()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names relative to `visual.`) into the parameters, cast to
        their dtype; returns the names loaded. An unknown name or a wrong shape is refused."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise InvalidArgument("weights", f"unknown vision tower tensor {name!r}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise InvalidArgument(
                    "weights",
                    f"vision tower tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}",
                )
            param.copy_(tensor)
            loaded.add(name)
        return loaded


class Qwen2_5VisionTower(VisionTower):
    """Qwen2.5-VL's `visual` module; parameter names are the checkpoint's after `visual.`."""

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec = VisionSpec.from_hf(vision_config)
        self.dtype = dtype
        self.patch_embed = _PatchEmbed(spec, dtype)
        self.blocks = nn.ModuleList([_Block(spec, dtype) for _ in range(spec.depth)])
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
