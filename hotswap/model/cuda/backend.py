"""The Triton attention backend (vLLM's TRITON_ATTN): the natural paged cache, new keys and
values written by the store kernel (into an FP8 cache quantized with the layer's scales),
decode rows through the split-K paged kernel in one launch pair, prefill and chunked
prefill through the packed prefill kernel.

Its step inputs are built from the scheduler's lists in one buffer and uploaded in one
asynchronous copy (`TritonStepInputs`): token ids, positions, slots, the rows sampled
from, and both kernels' block tables and lengths. In batch-invariant mode (`unified`)
every row, decode rows too, goes through the prefill kernel, whose result for a query
depends only on its own context (attention_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotswap.execution.step_inputs import StepBatch, StepInputs
from hotswap.model.attention import (
    AttentionMetadata,
    CacheSpec,
    DecodeBatch,
    natural_cache,
)
from hotswap.model.cuda import ops
from hotswap.model.cuda.staging import Staging

# Programs the decode kernel should launch at least (about two per multiprocessor of a
# large GPU): fewer sequences x kv heads split their context into more ranges. Triton's
# interpreter runs programs one by one: there, a few.
DECODE_PROGRAMS = 4 if ops.INTERPRETED else 256
MAX_SPLITS = 16


def decode_splits(seqs: int, kv_heads: int) -> int:
    """Context ranges per sequence for a decode batch of `seqs` (a function of the batch
    size alone, so a captured graph keeps it)."""
    return max(1, min(MAX_SPLITS, -(-DECODE_PROGRAMS // max(1, seqs * kv_heads))))


@dataclass
class PrefillBatch:
    """The multi-query sequences of a step, as `ops.paged_prefill_` reads them."""

    tables: torch.Tensor  # [seqs, width]
    starts: torch.Tensor  # first row of each sequence's queries
    query_lens: torch.Tensor
    lens: torch.Tensor  # context length after this step
    tile_seqs: torch.Tensor
    tile_firsts: torch.Tensor


class TritonAttention:
    reads_decode_batch = True

    def __init__(self, unified: bool = False) -> None:
        self.unified = unified
        self.kv_heads = 1  # this rank's, known with the cache (make_cache)

    def make_cache(self, num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv_heads = spec.num_kv_heads
        return natural_cache(num_blocks, spec)

    def forward(self, query, key, value, kv_cache, meta, scale, kv_scales=None):  # noqa: ANN001
        # kv_scales: an FP8 cache's (k_scale, v_scale), host floats fixed at start
        k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
        gpu = torch.ops.hotswap_gpu
        k_cache, v_cache = kv_cache
        gpu.store_kv_(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = query.new_empty(query.shape)
        decode = meta.decode_batch
        if decode is not None:
            gpu.paged_decode_(
                out, query[decode.rows], k_cache, v_cache, decode.block_tables,
                decode.context_lens, scale, decode.num_splits, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        prefill = meta.prefill_batch
        if prefill is not None:
            gpu.paged_prefill_(
                out, query, k_cache, v_cache, prefill.tables, prefill.starts,
                prefill.query_lens, prefill.lens, prefill.tile_seqs, prefill.tile_firsts, scale,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return out

    def graph_metadata(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                       positions: torch.Tensor, block_size: int) -> AttentionMetadata:  # fmt: skip
        """A decode step's metadata from a graph's static inputs, made with device ops only
        (inside the captured forward): the split-K decode kernel, or in batch-invariant
        mode the prefill kernel with one query per sequence, in a tile aligned to its
        position."""
        rows = slots.shape[0]
        meta = AttentionMetadata(slots, [], [], [], block_size)
        if not self.unified:
            splits = decode_splits(rows, self.kv_heads)
            meta.decode_batch = DecodeBatch(
                rows=slice(0, rows), block_tables=tables, context_lens=lens, num_splits=splits
            )
            return meta
        index = torch.arange(rows, device=slots.device)
        meta.prefill_batch = PrefillBatch(
            tables=tables, starts=index, query_lens=torch.ones_like(index), lens=lens,
            tile_seqs=index, tile_firsts=-(positions % ops.PREFILL_BLOCK_M),
        )  # fmt: skip
        return meta

    def step_inputs(self, batch: StepBatch, staging: Staging, block_size: int) -> StepInputs:
        """The step's tensors, views of one upload."""
        layout = _Layout(batch, self.unified)
        values = layout.pack(batch, block_size)
        device = staging.upload(values)
        meta = AttentionMetadata(
            slot_mapping=layout.view(device, "slots"),
            sequences=[],
            decode_sequences=[],
            decode_groups=[],
            block_size=block_size,
            decode_batch=self._decode_batch(layout, device),
            prefill_batch=self._prefill_batch(layout, device),
        )
        return StepInputs(
            input_ids=layout.view(device, "input_ids"),
            positions=layout.view(device, "positions"),
            logits_rows=layout.view(device, "logits_rows"),
            meta=meta,
            prompt_rows=batch.prompt_rows,
        )

    def _decode_batch(self, layout: _Layout, device: torch.Tensor) -> DecodeBatch | None:
        seqs = layout.decode_count
        if not seqs:
            return None
        return DecodeBatch(
            rows=slice(0, seqs),
            block_tables=layout.view(device, "decode_tables").view(seqs, -1),
            context_lens=layout.view(device, "decode_lens"),
            num_splits=decode_splits(seqs, self.kv_heads),
        )

    @staticmethod
    def _prefill_batch(layout: _Layout, device: torch.Tensor) -> PrefillBatch | None:
        seqs = len(layout.prefill)
        if not seqs:
            return None
        return PrefillBatch(
            tables=layout.view(device, "prefill_tables").view(seqs, -1),
            starts=layout.view(device, "starts"),
            query_lens=layout.view(device, "query_lens"),
            lens=layout.view(device, "lens"),
            tile_seqs=layout.view(device, "tile_seqs"),
            tile_firsts=layout.view(device, "tile_firsts"),
        )


class _Layout:
    """Where each of a step's lists lies in the one uploaded buffer. Decode rows (single
    queries) come first in a step (the runner sorts them so): rows 0..decode_count-1."""

    def __init__(self, batch: StepBatch, unified: bool) -> None:
        single = [n == 1 for n in batch.query_lens]
        self.unified = unified
        self.decode_count = 0 if unified else _leading(single)
        self.prefill = list(range(self.decode_count, len(batch.query_lens)))
        self.spans: dict[str, tuple[int, int]] = {}

    def pack(self, batch: StepBatch, block_size: int) -> list[int]:
        values: list[int] = []

        def add(name: str, items: list[int]) -> None:
            self.spans[name] = (len(values), len(values) + len(items))
            values.extend(items)

        add("input_ids", batch.input_ids)
        add("positions", batch.positions)
        add("slots", batch.slots)
        add("logits_rows", batch.logits_rows)
        decode = range(self.decode_count)
        add("decode_tables", _padded([batch.tables[i] for i in decode]))
        add("decode_lens", [batch.context_lens[i] for i in decode])
        query_lens = [batch.query_lens[i] for i in self.prefill]
        starts = [sum(batch.query_lens[:i]) for i in self.prefill[:1]]
        for count in query_lens[:-1]:
            starts.append(starts[-1] + count)
        add("prefill_tables", _padded([batch.tables[i] for i in self.prefill]))
        add("starts", starts)
        add("query_lens", query_lens)
        lens = [batch.context_lens[i] for i in self.prefill]
        add("lens", lens)
        aligned = [n - q for n, q in zip(lens, query_lens)] if self.unified else None
        tile_seqs, tile_firsts = ops.prefill_tiles(query_lens, first_positions=aligned)
        add("tile_seqs", tile_seqs)
        add("tile_firsts", tile_firsts)
        return values

    def view(self, device: torch.Tensor, name: str) -> torch.Tensor:
        start, end = self.spans[name]
        return device[start:end]


def _leading(flags: list[bool]) -> int:
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return count


def _padded(tables: list[list[int]]) -> list[int]:
    """Rows of equal width (at least one column), flattened; padding reads block 0."""
    width = max((len(t) for t in tables), default=1) or 1
    return [block for table in tables for block in table + [0] * (width - len(table))]
