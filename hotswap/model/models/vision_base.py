"""What both Qwen vision towers (vision.py, vision_qwen3.py) share: the shape keys their
config.json both has, frozen linear layers, a block's attention and its pre-norm layout,
the 2-D rotary over merge-block positions, segment grouping for attention, and a tower's
input checks and loading by checkpoint name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hotswap.errors import InvalidArgument

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


class VisionBlock(nn.Module):
    """A tower block (both Qwen towers'): pre-norm attention, then a pre-norm MLP, each
    added to the stream. `norm`: the norm's class (size, dtype)."""

    def __init__(
        self,
        spec: TowerSpec,
        dtype: torch.dtype,
        norm: Callable[[int, torch.dtype], nn.Module],
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.norm1 = norm(spec.hidden_size, dtype)
        self.norm2 = norm(spec.hidden_size, dtype)
        self.attn = VisionAttention(spec, dtype)
        self.mlp = mlp

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: list[Tensor]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


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
