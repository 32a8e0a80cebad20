"""Which kernels an engine runs: its attention backend (vLLM's --attention-backend names)
and the ops its layers call instead of torch's.

- TRITON_ATTN: the Triton kernels (model/cuda): paged attention, the KV store, fused
  norms, RoPE and SiLU-and-mul; the default on CUDA where Triton is installed. On the host
  only under Triton's interpreter (the tests).
- CPU_ATTN: hotswap's CPU kernels (model/kernels); the default on the CPU.
- TORCH_SDPA: torch operators only (the batch-invariant torch path in that mode).

Every backend serves an FP8 KV cache (--kv-cache-dtype fp8, fp8_e5m2; model/kv_fp8.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.config import EngineConfig
from hotswap.errors import InvalidArgument
from hotswap.model.attention import (
    AttentionBackend,
    BatchInvariantAttention,
    TorchPagedAttention,
)
from hotswap.model.attention_kernel import PagedKernelAttention
from hotswap.model.cuda import triton_runs_on
from hotswap.model.kernels import CpuKernels, LayerKernels

logger = logging.getLogger(__name__)


@dataclass
class KernelChoice:
    name: str  # TRITON_ATTN, CPU_ATTN or TORCH_SDPA
    backend: AttentionBackend
    layer_kernels: LayerKernels | None  # what the model's layers call (None: torch's)
    cpu_kernels: CpuKernels | None  # the CPU kernels (packed weights, compiled steps)
    staging: Any = None  # the Triton backend's step-input uploads (cuda/staging.py)


def choose_kernels(config: EngineConfig, device: torch.device, progress: bool) -> KernelChoice:
    name = _backend_name(config, device)
    if name == "TRITON_ATTN":
        return _triton(config, device)
    if name == "CPU_ATTN":
        kernels = CpuKernels.load(progress)
        if kernels is not None:
            return KernelChoice(name, PagedKernelAttention(kernels), kernels, kernels)
        if config.attention_backend == name:
            raise InvalidArgument("attention_backend", "attention_backend: CPU_ATTN: hotswap's "
                                  "CPU kernels cannot be built on this machine")  # fmt: skip
    torch_backend = BatchInvariantAttention() if config.batch_invariant else TorchPagedAttention()
    return KernelChoice("TORCH_SDPA", torch_backend, None, None)


def _backend_name(config: EngineConfig, device: torch.device) -> str:
    """The configured backend, checked against the device, or the device's default."""
    name = config.attention_backend
    if name is None:
        if device.type == "cuda":
            return "TRITON_ATTN" if triton_runs_on(device) else "TORCH_SDPA"
        if device.type == "cpu" and config.cpu_kernels and not config.batch_invariant:
            return "CPU_ATTN"
        return "TORCH_SDPA"
    if name == "TRITON_ATTN" and not triton_runs_on(device):
        why = "Triton is not installed" if device.type == "cuda" else (
            "on the host the Triton kernels run only under Triton's interpreter "
            "(TRITON_INTERPRET=1, Triton installed)")  # fmt: skip
        raise InvalidArgument("attention_backend", f"attention_backend: TRITON_ATTN: {why}")
    cpu_ok = device.type == "cpu" and config.cpu_kernels and not config.batch_invariant
    if name == "CPU_ATTN" and not cpu_ok:
        raise InvalidArgument(
            "attention_backend",
            "attention_backend: CPU_ATTN runs on the CPU, with the CPU kernels on, outside "
            "batch-invariant mode",
        )
    return name


def _triton(config: EngineConfig, device: torch.device) -> KernelChoice:
    from hotswap.model.cuda import ops
    from hotswap.model.cuda.backend import TritonAttention
    from hotswap.model.cuda.staging import Staging

    backend = TritonAttention(unified=config.batch_invariant)
    return KernelChoice("TRITON_ATTN", backend, ops.layer_kernels(), None, Staging(device))
