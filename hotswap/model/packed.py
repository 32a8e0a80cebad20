"""bf16 linear weights kept a second time in oneDNN's packed layout, for batches too big
for the GEMV kernel. F.linear reorders a plain weight inside every call; measured on the
default model's layers, the packed copy makes 12-128-row products 15-25% faster and the
LM head's 40-50% (README, Benchmarks). On CPUs with AMX, a third copy packed into tiles
for hotswap's own kernel (csrc/amx_linear.cpp) serves batches of up to `TILES_MAX_ROWS`
rows, where it streams the weights faster than oneDNN (README, CPU kernels: one step's
layers 12.2 vs 16.0 ms at 16 rows, 13.4 vs 18.2 at 32, 21.3 vs 22.0 at 64).

A packed copy is derived data: it is made at engine start and dropped whenever the
weights may have changed (`invalidate`), so the next step that needs it repacks from the
live parameters (~0.1 s for the default model). The engine invalidates on every weight
commit, reload, wake-up and worker-extension call; a copy is never read after its weight
changed."""

from __future__ import annotations

import functools

import torch

from hotswap.model.kernels import CpuKernels

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


# Up to this many rows the AMX kernel's tiles serve; from ~96 rows oneDNN's blocking for
# cache reuse wins (measured on the default model's layers).
TILES_MAX_ROWS = 64


def tiles_apply(kernels: CpuKernels | None, weight: torch.Tensor) -> bool:
    """Whether the AMX kernel serves `weight`: built and allowed here, bf16, and both
    sides whole tile pairs (multiples of 32)."""
    return (
        kernels is not None
        and kernels.amx_linear is not None
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % 32 == 0
        and weight.shape[1] % 32 == 0
    )


def packed_copy(weight: torch.Tensor, kernels: CpuKernels | None = None) -> PackedWeight:
    """`weight`'s packed copies, made now: oneDNN's, and the AMX tiles where `kernels`
    serve this weight (decided here once, not in every step)."""
    holder = PackedWeight(kernels if tiles_apply(kernels, weight) else None)
    holder.pack(weight)
    return holder


class PackedWeight:
    """One weight's packed copies (`pack`), remade on first use after `invalidate`:
    oneDNN's, and the AMX kernel's tiles when given `tile_kernels` (made by
    `packed_copy`, which checks that they serve the weight)."""

    __slots__ = ("_packed", "_tiles", "_tile_kernels")

    def __init__(self, tile_kernels: CpuKernels | None = None) -> None:
        self._packed: torch.Tensor | None = None
        self._tiles: torch.Tensor | None = None
        self._tile_kernels = tile_kernels

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self._tile_kernels is not None and x.shape[0] <= TILES_MAX_ROWS:
            return self._tile_kernels.amx_linear(x, self.tiles(weight), bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn(weight), bias, "none", [], "")

    def pack(self, weight: torch.Tensor) -> None:
        """Make every copy `weight` uses now, if it has none."""
        self.onednn(weight)
        if self._tile_kernels is not None:
            self.tiles(weight)

    def onednn(self, weight: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        return self._packed

    def tiles(self, weight: torch.Tensor) -> torch.Tensor:
        if self._tiles is None:
            self._tiles = self._tile_kernels.amx_pack_weight(weight)
        return self._tiles

    def invalidate(self) -> None:
        self._packed = self._tiles = None

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self._packed, self._tiles) if t is not None
        )
