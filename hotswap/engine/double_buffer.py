"""Double-buffered weights (`WeightTransferConfig(double_buffer=True)`): a second copy of
every parameter, the *shadow*, that a round is written into while steps keep reading the
live weights; the commit swaps the two, parameter by parameter (`param.data` pointers),
so the switch between two steps costs microseconds per tensor instead of a copy of the
model.

Only the parameters a round writes are swapped, so a round that writes some weights
(partial updates) leaves the others as they are; a parameter the round writes only part
of (one shard of a fused tensor, a sparse delta) is first refreshed from the live weights,
on the receiving thread while steps run, never at the switch. A complete round costs one
copy of what was sent into the shadow, beside the steps, and the pointer swaps.

Memory: one more copy of the weights. That is the memory the receive-buffer pool already
holds between rounds (`reuse_receive_buffers`), and a double-buffered round writes into
the shadow instead of the pool, so the engine needs no more than before unless the pool
was off. A budget that cannot hold it is refused at start, unless `allow_copy_fallback`
says to switch by copying instead."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.model.packed import available_bytes
from hotswap.weight_transfer.base import ParamMeta

logger = logging.getLogger(__name__)

FIELD = "weight_transfer_config.double_buffer"
HEADROOM = 0.9  # of the available memory a second copy may take


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))


def fits(model: nn.Module, device: torch.device, allow_fallback: bool) -> bool:
    """Whether a shadow copy fits; InvalidArgument if not and no fallback is allowed."""
    need, have = weight_bytes(model), available_bytes(device)
    if need <= HEADROOM * have:
        return True
    message = (
        f"double_buffer: a second copy of the weights needs {need / 2**30:.2f} GiB, but "
        f"only {have / 2**30:.2f} GiB is available on {device}; turn it off, or set "
        f"allow_copy_fallback to switch weights by copying instead"
    )
    if not allow_fallback:
        raise InvalidArgument(FIELD, message)
    logger.warning("%s: falling back to copying at the switch", message)
    return False


class ShadowWeights:
    def __init__(self, model: nn.Module) -> None:
        self.params: dict[str, nn.Parameter] = model.parameter_index()
        self.shadow: dict[str, torch.Tensor] = {}  # allocated per parameter on first write
        self.written: set[str] = set()  # parameters the open round wrote into the shadow

    def claim(self, name: str, whole: bool) -> torch.Tensor:
        """Parameter `name`'s shadow, ready for the round to write into. The first write of
        a round that covers only part of it (a shard of a fused tensor, a sparse delta)
        first refreshes it from the live weights, so the parts the round leaves alone
        commit unchanged; a whole write needs no refresh."""
        live = self.params[name].data
        buffer = self.shadow.get(name)
        if buffer is None or buffer.shape != live.shape or buffer.dtype != live.dtype:
            buffer = self.shadow[name] = torch.empty_like(live)
        if name not in self.written:
            if not whole:
                with torch.no_grad():
                    buffer.copy_(live)
            self.written.add(name)
        return buffer

    def destination(self, live_view: torch.Tensor, name: str, sparse: bool = False) -> torch.Tensor:
        """The shadow's counterpart of `live_view`, a view into parameter `name` (all of
        it, or a shard of a fused one), claimed for writing (`sparse`: only some of its
        elements will be written)."""
        param = self.params[name].data
        whole = not sparse and live_view.numel() == param.numel()
        shadow = self.claim(name, whole)
        offset = live_view.storage_offset() - param.storage_offset()
        return shadow.as_strided(live_view.shape, live_view.stride(),
                                 shadow.storage_offset() + offset)  # fmt: skip

    def receive_buffer(self, meta: ParamMeta, target: tuple[str, torch.Tensor] | None,
                       fallback: Callable[[ParamMeta], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """Where to receive `meta`: straight into the shadow when the sent tensor has the
        destination's exact dtype and shape (and the view is contiguous), else a buffer
        from `fallback` that `write` copies in."""
        if target is not None:
            name, live_view = target
            if (live_view.dtype == meta.dtype and tuple(live_view.shape) == meta.shape
                    and live_view.is_contiguous()):  # fmt: skip
                return self.destination(live_view, name)
        return fallback(meta)

    @torch.no_grad()
    def write(self, received: torch.Tensor, view: torch.Tensor) -> None:
        """Copy a received tensor into its shadow view (unless it was received there)."""
        if received.data_ptr() != view.data_ptr() or received.dtype != view.dtype:
            view.copy_(received)

    def discard_round(self) -> None:
        """The open round will not be committed: what it wrote is forgotten (a later
        partial write refreshes from the live weights again)."""
        self.written.clear()

    def release(self) -> None:
        """Free the shadow (sleep); later rounds allocate it again."""
        self.shadow.clear()
        self.written.clear()

    def swap(self) -> None:
        """The switch: every parameter the round wrote now reads its shadow, whose
        buffer keeps the previous weights for reuse; the others stay as they are."""
        for name in self.written:
            param = self.params[name]
            param.data, self.shadow[name] = self.shadow[name], param.data
        self.written.clear()
