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
says to switch by copying instead.

Under tensor parallelism every rank holds a shadow of its own share (model/shadow.py).
On a CPU the ranks share the host's memory, so the check counts all of their shares."""

from __future__ import annotations

import logging

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.model.packed import available_bytes

logger = logging.getLogger(__name__)

FIELD = "weight_transfer_config.double_buffer"
HEADROOM = 0.9  # of the available memory a second copy may take


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))


def fits(model: nn.Module, device: torch.device, allow_fallback: bool, ranks: int = 1) -> bool:
    """Whether a shadow copy fits (of `model`, one rank's share, times the `ranks` whose
    shares share `device`'s memory); InvalidArgument if not and no fallback is allowed."""
    need, have = weight_bytes(model) * ranks, available_bytes(device)
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
