"""Builds a model from a Hugging Face-format directory and fills its weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from hotswap.config import ModelConfig
from hotswap.errors import InvalidArgument
from hotswap.model.attention import AttentionBackend
from hotswap.model.kv_fp8 import set_checkpoint_kv_scales, split_kv_scales
from hotswap.model.models.registry import get_model_class
from hotswap.model.parallel import TPGroup
from hotswap.model.quantized import SCALE_NAME
from hotswap.model.reference import refresh_references
from hotswap.weights.checkpoint import iter_safetensors, num_tensors, safetensors_files


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    batch_invariant: bool,
    progress: bool = True,
    device: torch.device | str = "cpu",
    tp: TPGroup | None = None,
) -> nn.Module:
    """The model with its parameters and buffers allocated on `device`; checkpoint
    tensors are read on the host and copied in."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device):
        model = model_cls(
            config.hf_config, config.dtype, backend, batch_invariant, config.head_dtype, tp
        )
        if config.quantization is not None:
            model.quantize(config.quantization)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_checkpoint(model, config.path, progress)
    # keep_reference: an FP8 checkpoint's references (dummy weights: every one) from codes
    refresh_references(model, everything=config.load_format == "dummy")
    return model.eval()


def load_checkpoint(model: nn.Module, model_dir: Path, progress: bool = True) -> None:
    files = safetensors_files(model_dir)
    total = sum(num_tensors(f) for f in files)
    bar = tqdm(
        total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False
    )
    kv_scales: dict[int, dict[str, float]] = {}  # an FP8 KV cache's, where it has them
    with torch.no_grad():
        loaded = model.load_weights(split_kv_scales(_counting(iter_safetensors(files), bar),
                                                    kv_scales))  # fmt: skip
    bar.close()
    try:
        set_checkpoint_kv_scales(model, kv_scales)
    except ValueError as e:
        raise InvalidArgument("model", str(e)) from None
    missing = sorted(model.expected_checkpoint_keys() - loaded)
    if missing:
        shown = ", ".join(model.checkpoint_name(name) for name in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        # The checkpoint the caller named (EngineArgs.model) is incomplete.
        raise InvalidArgument("model", f"weights: {model_dir} is missing weights for {shown}{more}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of sane scale (unit norms, zero biases) for load tests and demos;
    drawn on the host, so every device gets the same weights for a seed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(SCALE_NAME):  # FP8 codes then stand for values
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator) * 0.02
                param.copy_(values)


def _counting(
    items: Iterator[tuple[str, torch.Tensor]], bar: tqdm
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in items:
        yield item
        bar.update(1)
