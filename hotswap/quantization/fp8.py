"""Blockwise FP8 weights, as vLLM serves them with `quant_method: fp8` and a
`weight_block_size`: each linear weight stored as float8 e4m3 codes, one float32 scale per
[block_n x block_k] block (`weight_scale_inv`: multiply a code by it to get the value).

The quantizer is vLLM's `per_block_cast_to_fp8` arithmetic (the one DeepGEMM, SGLang and
the RL frameworks' trainer-side quantizers share), so an engine that quantizes what a
trainer sends holds the same codes and scales as a checkpoint quantized by them: per block,
`amax = max|w|` in float32, clamped below at 1e-4; `scale = amax / 448`; codes
`w * (1 / scale)` rounded to e4m3 (to nearest even). A partial last block (a dimension not
divisible by the block) is scaled over the values it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hotswap.errors import InvalidArgument

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # an all-zero block gets this amax, so its scale is never zero
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Config:
    """What `--quantization fp8` or a checkpoint's `quantization_config` asks for.
    `ignored_layers`: module-name prefixes kept unquantized (vLLM's key; transformers
    writes `modules_to_not_convert`).

    `keep_reference`: keep a copy of each quantized weight in the model dtype, as received
    (bf16/float32 tensors as sent, sparse deltas as a bf16 engine applies them; FP8 codes
    sent as they are: their dequantized values), for scoring with the unquantized policy
    (model/reference.py serving_reference). Not a parameter: digests and checkpoint keys
    are unchanged. Memory: the weights then take the model dtype's bytes plus the FP8
    codes' (bf16: 3 bytes a weight instead of 1), and a double buffer's shadow twice that."""

    block: tuple[int, int] = DEFAULT_BLOCK  # (block_n: output rows, block_k: input columns)
    ignored_layers: tuple[str, ...] = ()
    keep_reference: bool = False  # not a checkpoint key: set by the engine (dataclasses.replace)

    @classmethod
    def from_hf(
        cls, config: dict[str, Any] | None, field: str = "quantization_config",
        keep_reference: bool = False,
    ) -> Fp8Config:  # fmt: skip
        """From a `quantization_config` dict (None: the defaults); InvalidArgument naming
        the key for what vLLM refuses too, or what hotswap does not serve."""
        config = dict(config or {})
        method = config.get("quant_method", "fp8")
        if method != "fp8":
            raise InvalidArgument(
                f"{field}.quant_method",
                f"{field}.quant_method: {method!r} is not served; hotswap quantizes to fp8",
            )
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise InvalidArgument(
                f"{field}.fmt", f"{field}.fmt: {fmt!r} is not supported; use 'e4m3'"
            )
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise InvalidArgument(
                f"{field}.activation_scheme",
                f"{field}.activation_scheme: {scheme!r} is not supported; use 'dynamic' "
                f"(activations stay in the model dtype; only weights are FP8)",
            )
        block = _block(config.get("weight_block_size"), f"{field}.weight_block_size")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        if not isinstance(ignored, list) or not all(isinstance(n, str) for n in ignored):
            raise InvalidArgument(
                f"{field}.ignored_layers", f"{field}.ignored_layers: must be a list of names"
            )
        return cls(block=block, ignored_layers=tuple(ignored), keep_reference=keep_reference)

    def quantizes(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` (engine or checkpoint spelling) is FP8."""
        return not any(
            module_name == name or module_name.startswith(name + ".")
            for name in self.ignored_layers
        )


def _block(value: object, field: str) -> tuple[int, int]:
    if value is None:
        return DEFAULT_BLOCK
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise InvalidArgument(field, f"{field}: must be two integers [block_n, block_k]")
    block_n, block_k = value
    # The CPU kernel reads codes 16 at a time within a block.
    if block_n < 1 or block_k < 16 or block_k % 16:
        raise InvalidArgument(
            field,
            f"{field}: {list(value)} not supported; block_n must be positive and block_k a "
            f"multiple of 16",
        )
    return block_n, block_k


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The `weight_scale_inv` shape of a [n, k] weight."""
    n, k = shape
    return -(-n // block[0]), -(-k // block[1])


def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes shaped like `weight`, float32 scales [ceil(n/bn), ceil(k/bk)])."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_blockwise: a 2-D weight, got {list(weight.shape)}")
    n, k = weight.shape
    rows, cols = scale_shape((n, k), block)
    padded = weight.new_zeros(rows * block[0], cols * block[1])
    padded[:n, :k] = weight
    blocks = padded.view(rows, block[0], cols, block[1])
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    codes = (blocks * (1.0 / scale)).to(FP8_DTYPE)
    return codes.view(padded.shape)[:n, :k].contiguous(), scale.view(rows, cols)


def expand_scales(
    scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]
) -> torch.Tensor:
    """Each element's scale: `scale` [ceil(n/bn), ceil(k/bk)] repeated over its blocks."""
    n, k = shape
    full = scale.repeat_interleave(block[0], dim=0)[:n]
    return full.repeat_interleave(block[1], dim=1)[:, :k]


def dequantize_blockwise(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The values `codes` stand for, in float32 rounded to `dtype`."""
    return (codes.float() * expand_scales(scale, tuple(codes.shape), block)).to(dtype)
