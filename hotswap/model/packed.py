"""bf16 linear weights kept a second time in oneDNN's packed layout, for batches too big
for the GEMV kernel. F.linear reorders a plain weight inside every call; measured on the
default model's layers, the packed copy makes 12-128-row products 15-25% faster and the
LM head's 40-50% (README, Benchmarks).

A packed copy is derived data: it is made at engine start and dropped whenever the
weights may have changed (`invalidate`), so the next step that needs it repacks from the
live parameters (~0.1 s for the default model). The engine invalidates on every weight
commit, reload, wake-up and worker-extension call; a copy is never read after its weight
changed."""

from __future__ import annotations

import functools

import torch

# Batch size oneDNN is told to expect when packing (the layout is good for 12-128 rows).
PACK_BATCH_HINT = 64


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on `device` (CUDA: free device memory; CPU: the
    kernel's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


@functools.cache
def can_pack() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU. Its bf16 path needs AVX512 (bw, vl,
    dq) or AVX-NE-CONVERT; an AVX2-only CPU (e.g. AMD Zen 3) refuses at the first reorder,
    so one tiny weight is packed here to ask, rather than parsing CPU flags."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return False
    probe = torch.zeros(16, 16, dtype=torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, PACK_BATCH_HINT)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class PackedWeight:
    """One weight's packed copy (`pack`), remade on first use after `invalidate`."""

    __slots__ = ("_packed",)

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.pack(weight), bias, "none", [], "")

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight`, made now if there is none."""
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        return self._packed

    def invalidate(self) -> None:
        self._packed = None

    @property
    def nbytes(self) -> int:
        return 0 if self._packed is None else self._packed.numel() * self._packed.element_size()
