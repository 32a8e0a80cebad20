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

Under tensor parallelism every rank holds a shadow of its own share; on a CPU the ranks
share the host's memory, so the check counts all of their shares. Rank 0 receives a
round's tensors whole and writes its part into its shadow, then sends the chunk over the
ranks' transfer channel (execution/ranks.py), where each rank's transfer thread writes
its part into its own shadow while its steps run; rank 0 raises the first rank's error
before the chunk counts as received. The commit's swap and sleep's release run on every
rank in step order (`on_every_rank`), so every rank switches between the same two steps;
a dropped round is forgotten over the transfer channel, since a round fails on the
thread that receives it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.execution.ranks import on_every_rank
from hotswap.model.packed import available_bytes
from hotswap.model.parallel import ShardSlice, TPGroup
from hotswap.model.quantized import (
    quantize_into,
    requantize_delta,
    scale_name_of,
    scale_view_for,
)
from hotswap.model.reference import REFERENCE_SUFFIX, reference_tensors
from hotswap.model.reference_views import (
    Region,
    reference_view,
    region_of,
    set_reference,
    set_reference_flat,
)

logger = logging.getLogger(__name__)

FIELD = "weight_transfer_config.double_buffer"
HEADROOM = 0.9  # of the available memory a second copy may take


def weight_bytes(model: nn.Module) -> int:
    """What a shadow copy takes: the parameters, and FP8 layers' references if kept."""
    tensors = [*dict.fromkeys(model.parameters()), *reference_tensors(model).values()]
    return sum(t.numel() * t.element_size() for t in tensors)


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


# (parameter name, the live view a checkpoint tensor is written to): where a write lands.
Target = tuple[str, torch.Tensor]
SHADOW_WRITE = "shadow_write"  # the transfer-channel call `forward_to_shadows` sends
DROP_RECEIVED = "drop_received"  # and the one `drop_received` sends


class DeltaPart(NamedTuple):
    """A sparse change to a checkpoint tensor: `values` at its flat `indices` (whole)."""

    indices: torch.Tensor
    values: torch.Tensor


class ShadowWeights:
    """A second copy of a model's parameters (this rank's share), written by a round
    while steps read the live ones, and swapped in at its commit. An FP8 layer's reference
    weight (model/reference.py) is one more tensor here, named after its codes with
    REFERENCE_SUFFIX: claimed, swapped and dropped as a parameter is (its `.data` swaps:
    the layout keeps the same tensor object)."""

    def __init__(self, model: nn.Module) -> None:
        self.params: dict[str, torch.Tensor] = {**model.parameter_index(),
                                                **reference_tensors(model)}  # fmt: skip
        self.shadow: dict[str, torch.Tensor] = {}  # allocated per parameter on first write
        self.written: set[str] = set()  # parameters the open round wrote into the shadow
        # FP8 codes the open round wrote as sent: (layout, region), whose references are
        # derived after the swap (model/reference.py refresh_references); dropped with it
        self.codes_as_sent: list[tuple[Any, Region]] = []

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

    def receive_buffer(self, meta: Any, target: Target | None,
                       fallback: Callable[[Any], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """Where to receive `meta` (a weight_transfer ParamMeta): straight into the shadow
        when the sent tensor has the destination's exact dtype and shape (and the view is
        contiguous), else a buffer from `fallback` that `write` copies in."""
        if target is not None:
            name, live_view = target
            if (live_view.dtype == meta.dtype and tuple(live_view.shape) == meta.shape
                    and live_view.is_contiguous()):  # fmt: skip
                return self.destination(live_view, name)
        return fallback(meta)

    def reference_destination(
        self, layer: Any, target: Target, sparse: bool
    ) -> torch.Tensor | None:
        """The shadow's view of FP8 `layer`'s reference where `target`'s codes are written,
        claimed as `destination` claims the codes' (None: the layer keeps none)."""
        live = reference_view(layer, target[1])
        if live is None:
            return None
        return self.destination(live, target[0] + REFERENCE_SUFFIX, sparse)

    def note_codes_as_sent(self, layer: Any, view: torch.Tensor) -> None:
        """FP8 codes written as sent into shadow `view` (model/reference_views.py)."""
        if layer.fp8.reference is not None:
            self.codes_as_sent.append((layer.fp8, region_of(layer.weight.data, view)))

    @torch.no_grad()
    def write(self, received: torch.Tensor, view: torch.Tensor) -> None:
        """Copy a received tensor into its shadow view (unless it was received there)."""
        if received.data_ptr() != view.data_ptr() or received.dtype != view.dtype:
            view.copy_(received)

    def discard_round(self) -> None:
        """The open round will not be committed: what it wrote is forgotten (a later
        partial write refreshes from the live weights again)."""
        self.written.clear()
        self.codes_as_sent.clear()

    def release(self) -> None:
        """Free the shadow (sleep); later rounds allocate it again."""
        self.shadow.clear()
        self.written.clear()
        self.codes_as_sent.clear()

    def swap(self, in_place: bool = False) -> None:
        """The switch: every parameter the round wrote now reads its shadow, whose
        buffer keeps the previous weights for reuse; the others stay as they are.
        `in_place`: copy the shadow into the live weights instead (a device copy), for
        whoever holds the weights' addresses (captured CUDA graphs)."""
        with torch.no_grad():
            for name in self.written:
                param = self.params[name]
                if in_place:
                    param.data.copy_(self.shadow[name])
                else:
                    param.data, self.shadow[name] = self.shadow[name], param.data
        self.written.clear()
        for layout, region in self.codes_as_sent:  # derived at the commit's weights_changed
            layout.stale.append(region)
        self.codes_as_sent.clear()


class RankShadow:
    """Mixed into ModelRunner (which provides `model`, `tp`, `transfer_channel`,
    `rank_stage`, `tell_workers` and `gather_errors`): this rank's shadow, and the calls
    that write, switch and drop it on every rank."""

    model: nn.Module
    tp: TPGroup
    transfer_channel: TPGroup
    shadow: ShadowWeights | None
    graphs: Any  # the runner's captured decode graphs (execution/cuda_graphs.py), or None
    rank_stage: dict[str, torch.Tensor]  # an m2n round's received parts (rank_weights.py)
    tell_workers: Callable[[tuple[str, tuple]], None]
    gather_errors: Callable[[str | None], list[str | None]]

    def rank_shadow(self) -> ShadowWeights:
        """This rank's shadow (made on first use: ranks 1.. when a round first writes)."""
        if self.shadow is None:
            self.shadow = ShadowWeights(self.model)
        return self.shadow

    @torch.no_grad()
    def write_shadow(self, target: Target, item: Any, piece: ShardSlice | None) -> torch.Tensor:
        """A received checkpoint tensor (whole) or `DeltaPart` into this rank's part of its
        shadow: `target` as the live weights have it, `piece` the part of the whole tensor
        this rank holds (None: all). Returns the shadow view written."""
        shadow = self.rank_shadow()
        sparse = not isinstance(item, torch.Tensor)
        view = shadow.destination(target[1], target[0], sparse)
        layer = getattr(self.model, "quantized_layer", lambda _: None)(target[0])
        scales = None
        if layer is not None:  # FP8: the part's scale rows are written (and swapped) too
            scale_name = scale_name_of(target[0])
            scales = shadow.destination(scale_view_for(layer, target[1]), scale_name, True)
        if not sparse:
            part = item if piece is None else piece.take(item)
            if layer is None or part.dtype == view.dtype:  # FP8 codes a trainer quantized
                shadow.write(part, view)
                if layer is not None:
                    shadow.note_codes_as_sent(layer, view)
            else:
                quantize_into(layer.fp8, view, scales, part)
                set_reference(shadow.reference_destination(layer, target, False), part)
            return view
        indices, values = item.indices.to(view.device), item.values
        if piece is not None:
            mask, indices = piece.local_indices(piece.full_shape(tuple(view.shape)), indices)
            values = values[mask.to(values.device)]
        if layer is None:
            view.view(-1)[indices] = values.to(view.device, view.dtype)
        else:
            requantize_delta(layer.fp8, view, scales, indices, values)
            set_reference_flat(shadow.reference_destination(layer, target, True), indices,
                               values)  # fmt: skip
        return view

    def forward_to_shadows(self, items: list[tuple[str, Any]]) -> None:
        """Rank 0: a chunk's received tensors and deltas to every other rank, each of which
        writes its part into its shadow; raises the first rank's error."""
        if not self.tp.parallel or not items:
            return
        sent = [(name, _parts(item)) for name, item in items]
        metas = [(name, [(p.shape, p.dtype, p.is_cuda) for p in parts]) for name, parts in sent]
        self.tell_workers((SHADOW_WRITE, (metas,)))
        for _, parts in sent:
            for part in parts:
                self.transfer_channel.broadcast(part.contiguous())
        for rank, error in enumerate(self.gather_errors(None)):
            if error is not None:
                raise RuntimeError(f"double buffer: tensor-parallel rank {rank} failed: {error}")

    def receive_shadow_writes(self, metas: list[tuple[str, list[tuple]]]) -> None:
        """Ranks 1.. (their transfer thread): what rank 0's `forward_to_shadows` sends.
        Every tensor is received before any is written, so the broadcasts pair up with
        rank 0's even when a write fails."""
        device = next(self.model.parameters()).device
        received = []
        for name, parts in metas:
            tensors = [torch.empty(shape, dtype=dtype, device=device if cuda else "cpu")
                       for shape, dtype, cuda in parts]  # fmt: skip
            received.append((name, [self.transfer_channel.broadcast(t) for t in tensors]))
        for name, tensors in received:
            target = self.model.checkpoint_view(name)
            if target is not None:
                item = tensors[0] if len(tensors) == 1 else DeltaPart(*tensors)
                param = (target[0].partition("#")[0], target[1])
                self.write_shadow(param, item, self.model.checkpoint_slice(name))

    @on_every_rank
    def swap_shadow(self) -> None:
        """The commit: every rank's shadow becomes its live weights (between two steps);
        by a device copy where CUDA graphs hold the weights' addresses (recapturing every
        graph would cost far more than the copy)."""
        self.rank_shadow().swap(in_place=self.graphs is not None)

    def drop_received(self) -> None:
        """A round that will not be committed: every rank forgets what it received of it
        (its shadow's writes, its m2n parts). Over the transfer channel, not the steps':
        a round fails on the thread that receives it, beside the steps."""
        self.tell_workers((DROP_RECEIVED, ()))
        self.forget_received()
        for rank, error in enumerate(self.gather_errors(None)):
            if error is not None:
                raise RuntimeError(f"dropping a round: tensor-parallel rank {rank} failed: "
                                   f"{error}")  # fmt: skip

    def forget_received(self) -> None:
        """This rank's part of `drop_received` (ranks 1..: on their transfer thread)."""
        self.rank_stage.clear()
        if self.shadow is not None:
            self.shadow.discard_round()

    @on_every_rank
    def release_shadow(self) -> None:
        """Sleep: every rank frees its shadow (later rounds allocate it again)."""
        if self.shadow is not None:
            self.shadow.release()


def _parts(item: Any) -> list[torch.Tensor]:
    return [item] if isinstance(item, torch.Tensor) else [item.indices, item.values]
