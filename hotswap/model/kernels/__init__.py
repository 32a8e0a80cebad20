"""hotswap's own CPU kernels (C++, built once per machine): paged decode attention that
reads the KV cache in place, a GEMV for the rows of a decode step, and fused RMSNorm and
RoPE. The engine falls back to torch's operators wherever they do not apply or cannot be
built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotswap.model.kernels.build import load_cpu_kernels

__all__ = ["CpuKernels", "load_cpu_kernels"]


@dataclass(frozen=True)
class CpuKernels:
    """The ops the model layers call (`torch.ops.hotswap_cpu.*`); a layer holding None
    instead runs torch operators."""

    gemv: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]  # mutates its residual argument
    rotary_embedding: Callable[..., None]  # in place
    paged_decode_attention: Callable[..., torch.Tensor]

    @classmethod
    def load(cls, progress: bool = True) -> CpuKernels | None:
        """The kernels, built first if need be; None if they cannot be built here."""
        if not load_cpu_kernels(progress):
            return None
        ops = torch.ops.hotswap_cpu
        return cls(ops.gemv, ops.rms_norm, ops.add_rms_norm, ops.rotary_embedding,
                   ops.paged_decode_attention)  # fmt: skip
