"""LoRA adapters applied without merging: base rows and rows of several adapters share a
step.

Each targeted linear layer holds `max_loras` slots of A and B matrices, zero-padded to
`max_lora_rank` (`LinearLoRA`). The runner orders a step's rows by adapter, so each
adapter's rows form contiguous segments (at most two: its decode rows, then its prefill
chunks), and every segment takes two matmuls per layer, its own rows times its own
adapter's matrices (the CPU analogue of punica's SGMV over segments): no Python loop per
request, no row computing another adapter's product, and base rows are not touched.

Which adapter sits in which slot is decided per step (`SlotTable`), as in vLLM: the
scheduler admits at most `max_loras` distinct adapters among running requests, so a step
always fits; slots of adapters the step does not use are reused least recently used first.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.lora.adapter import AdapterWeights
from hotswap.lora.experts import PARAMETERS as EXPERT_PARAMETERS
from hotswap.lora.experts import ExpertLoRA
from hotswap.model.layers import Linear, tiled_linear
from hotswap.model.moe import FusedExperts
from hotswap.model.parallel import ShardSlice


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of the step use the adapter in `slot`, whose products read its
    first `rank` columns (its own rank; `max_lora_rank` in batch-invariant mode, whose
    shapes must not depend on what else is in the batch)."""

    slot: int
    start: int
    end: int
    rank: int


@dataclass(frozen=True)
class Grouped:
    """Two or more segments as one padded batch: segment i's rows are `index[i*length:
    (i+1)*length]` (padding points at row 0 and is zeroed by `valid`), so every layer
    runs them in two batched matmuls whatever their number (at these sizes a matmul
    costs its call, ~20 us, more than its arithmetic)."""

    index: torch.Tensor  # [segments * length] rows of the step
    valid: torch.Tensor  # [segments, length, 1]: 1 for a real row, 0 for padding
    slots: tuple[int, ...]
    length: int
    rank: int

    @classmethod
    def of(cls, segments: list[Segment], dtype: torch.dtype, device: torch.device) -> Grouped:
        length = max(s.end - s.start for s in segments)
        index = torch.zeros(len(segments), length, dtype=torch.long)
        valid = torch.zeros(len(segments), length, 1, dtype=dtype)
        for i, s in enumerate(segments):
            index[i, : s.end - s.start] = torch.arange(s.start, s.end)
            valid[i, : s.end - s.start] = 1
        slots = tuple(s.slot for s in segments)
        rank = max(s.rank for s in segments)
        return cls(index.view(-1).to(device), valid.to(device), slots, length, rank)


@dataclass(frozen=True)
class LoRABatch:
    segments: list[Segment]
    invariant: bool
    grouped: Grouped | None = None  # set when two or more segments run batched


class LoRAContext:
    """Shared by every `LinearLoRA` of a model: the current step's batch (None: no row of
    the step uses an adapter, and the layers add nothing)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        self._row_slots: tuple[LoRABatch, torch.Tensor] | None = None

    def row_slots(self, rows: int, device: torch.device) -> torch.Tensor:
        """Each of the step's `rows` rows' slot (-1: the base model), made once per step
        (every routed experts block reads it)."""
        batch, cached = self.batch, self._row_slots
        assert batch is not None
        if cached is None or cached[0] is not batch or cached[1].shape[0] != rows:
            row_slot = torch.full((rows,), -1, dtype=torch.long)
            for segment in batch.segments:
                row_slot[segment.start : min(segment.end, rows)] = segment.slot
            cached = self._row_slots = (batch, row_slot.to(device))
        return cached[1]


class LinearLoRA:
    """A linear layer's adapter slots. Per slot, A `[shards * rank, in]` (the shards' A
    matrices stacked) and B `[shards * rank, out]`, block-diagonal: shard j's rows reach
    only its own output columns, so one product covers q, k and v (or gate and up). The
    scaling is folded into B. Plain tensors, not parameters: they are not the model's
    weights (digests, checksums and weight rounds never see them)."""

    def __init__(self, shard_sizes: Sequence[int], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device,
                 context: LoRAContext) -> None:  # fmt: skip
        self.shard_sizes = list(shard_sizes)
        self.offsets = [sum(self.shard_sizes[:j]) for j in range(len(self.shard_sizes))]
        self.max_rank = max_rank
        rows = len(self.shard_sizes) * max_rank
        self.a = torch.zeros(max_loras, rows, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, rows, sum(self.shard_sizes), dtype=dtype, device=device)
        self.context = context
        # slot -> (rank, A, B) cut to that rank, until the slot is written again
        self._cut: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._writes = 0  # any slot written: stacks of several slots are stale
        self._stack: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def write_slot(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's matrices for this layer in `slot` (shards it lacks: zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for shard, (a, b) in shards.items():
            rank, row = a.shape[0], shard * self.max_rank
            offset, size = self.offsets[shard], self.shard_sizes[shard]
            self.a[slot, row : row + rank].copy_(a)
            self.b[slot, row : row + rank, offset : offset + size].copy_(b.t())
        self._cut.pop(slot, None)
        self._writes += 1

    def clear_slot(self, slot: int) -> None:
        self.write_slot(slot, {})

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each segment's low-rank product (in place: `out` is the layer's fresh
        output; rows of no segment are the base model's)."""
        batch = self.context.batch
        if batch is None:
            return out
        if batch.grouped is not None:
            return self._add_grouped(x, out, batch.grouped)
        for segment in batch.segments:
            a, b = self._matrices(segment.slot, segment.rank)
            rows, target = x[segment.start : segment.end], out[segment.start : segment.end]
            if batch.invariant:  # fixed 16-row tiles, as the base layers
                target.add_(tiled_linear(tiled_linear(rows, a, None), b.t(), None))
            else:
                target.addmm_(F.linear(rows, a), b)
        return out

    def _add_grouped(self, x: torch.Tensor, out: torch.Tensor, g: Grouped) -> torch.Tensor:
        a, b = self._stacked(g.slots, g.rank)  # [S, shards * rank, in], [.., out]
        rows = x.index_select(0, g.index).view(len(g.slots), g.length, -1)
        shrink = torch.bmm(rows, a.transpose(1, 2)).mul_(g.valid)
        return out.index_add_(0, g.index, torch.bmm(shrink, b).view(-1, out.shape[1]))

    def _stacked(self, slots: tuple[int, ...], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B of `slots` (one entry per segment), cut to `rank`, stacked (cached
        until a slot is written)."""
        key = (slots, rank, self._writes)
        if self._stack is None or self._stack[0] != key:
            pairs = [self._matrices(slot, rank) for slot in slots]
            self._stack = (key, torch.stack([a for a, _ in pairs]),
                           torch.stack([b for _, b in pairs]))  # fmt: skip
        return self._stack[1], self._stack[2]

    def _matrices(self, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's A `[shards * rank, in]` and B `[shards * rank, out]`, cut to `rank`
        (a copy, made once per slot and rank; the whole slot is a view)."""
        if rank == self.max_rank:
            return self.a[slot], self.b[slot]
        cached = self._cut.get(slot)
        if cached is None or cached[0] != rank:
            shards = len(self.shard_sizes)
            a = self.a[slot].view(shards, self.max_rank, -1)[:, :rank].reshape(shards * rank, -1)
            b = self.b[slot].view(shards, self.max_rank, -1)[:, :rank].reshape(shards * rank, -1)
            cached = (rank, a.contiguous(), b.contiguous())
            self._cut[slot] = cached
        return cached[1], cached[2]


class SlotTable:
    """Which loaded adapter version (by uid) sits in which slot: decided on rank 0, the
    writes it implies made on every rank (`ModelLoRA.apply`)."""

    def __init__(self, layers: dict[str, LinearLoRA], max_loras: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # uid -> slot, LRU first

    def assign(
        self, adapters: Sequence[AdapterWeights]
    ) -> tuple[dict[int, int], list[tuple[int, AdapterWeights]]]:
        """Slots for the step's distinct adapters (at most `max_loras`: the scheduler's
        bound), and the adapters to write into their slot first; adapters the step does
        not use give theirs up, least recently used first."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"lora: {len(adapters)} adapters in one step, "
                               f"max_loras is {self.max_loras}")  # fmt: skip
        wanted = {adapter.uid for adapter in adapters}
        writes = []
        for adapter in adapters:
            if adapter.uid in self.slot_of:
                self.slot_of.move_to_end(adapter.uid)
                continue
            slot = self._free_slot(wanted)
            writes.append((slot, adapter))
            self.slot_of[adapter.uid] = slot
        return {adapter.uid: self.slot_of[adapter.uid] for adapter in adapters}, writes

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for uid, slot in self.slot_of.items():  # least recently used first
            if uid not in keep:
                del self.slot_of[uid]
                return slot
        raise RuntimeError("lora: no slot is free")  # assign's bound makes this unreachable

    def forget(self, uid: int) -> None:
        """An adapter version was unloaded: its slot is free (and zeroed; on rank 0 only,
        which is enough: a slot is written whole before it is used again)."""
        slot = self.slot_of.pop(uid, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)


def attach_lora(model: nn.Module, max_loras: int, max_rank: int,
                context: LoRAContext) -> dict[str, LinearLoRA | ExpertLoRA]:  # fmt: skip
    """Give every linear layer an adapter may target its slots, and every mixture of
    experts' routed experts theirs; returns them by name."""
    layers: dict[str, LinearLoRA | ExpertLoRA] = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            # its share of the intermediate dimension: whole under expert parallelism
            tp = model.tp
            share = (0, 1) if tp.expert_parallel else (tp.rank, tp.size)
            module.lora = layers[name] = ExpertLoRA(module, max_loras, max_rank, context,
                                                    model.local_experts(), *share)  # fmt: skip
        elif isinstance(module, Linear) and name.rsplit(".", 1)[-1] in LORA_LAYERS:
            weight = module.weight
            sizes = model.shard_sizes(name)
            module.lora = LinearLoRA(sizes, weight.shape[1], max_loras, max_rank,
                                     module.compute_dtype, weight.device, context)  # fmt: skip
            layers[name] = module.lora
    return layers


# The model's linear layers adapters may target (q/k/v and gate/up are fused).
LORA_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# An adapter's matrices for one linear layer: {shard: (A [r, in], B [out, r])}, whole.
LayerMatrices = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoRAPlan:
    """A step's adapters, decided on rank 0 and applied alike on every tensor-parallel
    rank: the slot writes the step needs first (slot, the adapter's matrices by layer,
    whole: each rank keeps its part), then the step's segments."""

    writes: list[tuple[int, dict[str, LayerMatrices]]]
    segments: list[Segment]


def rank_part(
    a: torch.Tensor, b: torch.Tensor, piece: ShardSlice | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one adapted weight's A `[r, in]` and B `[out, r]`, as vLLM
    splits LoRA: a column-parallel weight (its outputs split, dim 0) keeps A whole and
    its rows of B; a row-parallel one (its inputs split, dim 1) its columns of A and B
    whole, so the ranks' partial products sum to the adapter's in the layer's all-reduce."""
    if piece is None:
        return a, b
    return (a, piece.take(b)) if piece.dim == 0 else (piece.take(a), b)


class ModelLoRA:
    """A model's adapter slots and the per-step batching of its rows by adapter."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int,
                 invariant: bool) -> None:  # fmt: skip
        self.context = LoRAContext()
        self.layers = attach_lora(model, max_loras, max_rank, self.context)
        self.slots = SlotTable(self.layers, max_loras)
        self.max_loras, self.max_rank, self.invariant = max_loras, max_rank, invariant
        weight = next(layer.a for layer in self.layers.values() if isinstance(layer, LinearLoRA))
        self.dtype, self.device = weight.dtype, weight.device
        # per layer, per shard: this rank's slice of the weight (None: whole; routed experts
        # take their part themselves, ExpertLoRA.write_slot)
        self.pieces = {name: _pieces(model, name, len(layer.shard_sizes))
                       if isinstance(layer, LinearLoRA) else dict.fromkeys(EXPERT_PARAMETERS)
                       for name, layer in self.layers.items()}  # fmt: skip

    def plan(self, chunks: Sequence[tuple[AdapterWeights | None, int]]) -> LoRAPlan | None:
        """`chunks`: the step's chunks in row order, (adapter or None, rows), each
        adapter's chunks next to each other (the runner orders them so). None: no row
        uses an adapter."""
        adapters = list({a.uid: a for a, _ in chunks if a is not None}.values())
        if not adapters:
            return None
        slot_of, writes = self.slots.assign(adapters)
        segments: list[Segment] = []
        row = 0
        for adapter, rows in chunks:
            if adapter is not None:
                slot = slot_of[adapter.uid]
                last = segments[-1] if segments else None
                if last is not None and last.slot == slot and last.end == row:
                    segments[-1] = Segment(slot, last.start, row + rows, last.rank)
                else:
                    rank = self.max_rank if self.invariant else adapter.rank
                    segments.append(Segment(slot, row, row + rows, rank))
            row += rows
        return LoRAPlan([(slot, adapter.layers) for slot, adapter in writes], segments)

    @contextlib.contextmanager
    def apply(self, plan: LoRAPlan | None) -> Iterator[None]:
        """Inside, the layers add each row's adapter (`plan` None: nothing is added)."""
        if plan is None:
            yield
            return
        for slot, matrices in plan.writes:
            for name, layer in self.layers.items():
                pieces = self.pieces[name]
                parts = {shard: rank_part(a, b, pieces[shard])
                         for shard, (a, b) in matrices.get(name, {}).items()}  # fmt: skip
                layer.write_slot(slot, parts)
        grouped = None
        if len(plan.segments) > 1 and not self.invariant:  # batch-invariant: tiled
            grouped = Grouped.of(plan.segments, self.dtype, self.device)
        self.context.batch = LoRABatch(plan.segments, self.invariant, grouped)
        try:
            yield
        finally:
            self.context.batch = None


def _pieces(model: nn.Module, layer: str, shards: int) -> list[ShardSlice | None]:
    """This rank's slice of each checkpoint weight fused into `layer` (q/k/v, gate/up)."""
    if shards == 1:
        names = [model.checkpoint_name(f"{layer}.weight")]
    else:
        names = [model.checkpoint_name(f"{layer}.weight#{j}") for j in range(shards)]
    return [model.checkpoint_slice(name) for name in names]
