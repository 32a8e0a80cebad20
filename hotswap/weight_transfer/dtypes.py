"""The dtypes a weight round may carry, declared once: each by its name (torch's own,
`torch.bfloat16` is "bfloat16"; also accepted as torch prints it, "torch.bfloat16":
PipelineRL's and TRL's str(dtype)), the torch dtype of each name, and the code a
safetensors header gives it. Every backend, the verb table, the transfer infos and the
dialects read them from here.

A leaf: it imports no hotswap module but the leaf `hotswap.errors`."""

from __future__ import annotations

import torch

from hotswap.errors import InvalidArgument

# name -> torch dtype: what a tensor in a round may be.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    # FP8 weights a trainer quantized itself (with their float32 `weight_scale_inv`), for an
    # engine serving --quantization fp8 (model/quantized.py receipt_refusal)
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# A safetensors header's dtype code -> the torch dtype, for the codes a checkpoint may use
# (int16 is not read from checkpoint files).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: DTYPES[name]
    for code, name in (("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
                       ("F64", "float64"), ("I64", "int64"), ("I32", "int32"),
                       ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
                       ("F8_E4M3", "float8_e4m3fn"))
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """The name a round gives `dtype`; InvalidArgument if no round may carry it."""
    if dtype not in _NAMES:
        raise InvalidArgument("dtype", f"dtype: {dtype} cannot be transferred")
    return _NAMES[dtype]


def parse_dtype_name(name: object, field: str = "dtype_names") -> torch.dtype:
    """The torch dtype `name` (or "torch.<name>") stands for; InvalidArgument naming
    `field` otherwise."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPES:
        raise InvalidArgument(
            field, f"{field}: unknown dtype {name!r}; choose from {', '.join(DTYPES)}"
        )
    return DTYPES[name.removeprefix("torch.")]
