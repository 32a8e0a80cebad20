"""Paged attention over a mixed batch of variable-length sequences.

Every step, each layer first writes the new tokens' K/V into the paged cache, then every
query attends to its sequence's keys read back from the cache. That one order makes prefix
hits, chunked prefill and decode the same case: a sequence's context is whatever its block
table holds. Backends share the metadata; a CUDA backend can replace the torch one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from hotswap.model.kv_fp8 import dequantize_kv, quantize_kv

# A layer's FP8 KV scales (k_scale, v_scale), or None where the cache holds the model dtype.
KVScales = tuple[float, float] | None


@dataclass(frozen=True)
class CacheSpec:
    """What a layer's KV cache holds: its blocks' size and the model's attention shape;
    `dtype`, the cache's (float8_e4m3fn or float8_e5m2 for an FP8 cache, else the model's)."""

    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the cache's (float8_e4m3fn or float8_e5m2 for an FP8 cache)
    device: torch.device
    compute_dtype: torch.dtype | None = None  # the queries' (None: `dtype`)


def natural_cache(num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, block_size, kv_heads, head_dim] keys and values, zeroed."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return tuple(torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(2))


@dataclass
class SequenceSlice:
    row_start: int  # first row of this sequence's queries in the flattened batch
    num_queries: int
    context_len: int  # tokens with KV after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class DecodeGroup:
    """Single-query sequences of similar context length, attended in one padded call."""

    rows: slice | torch.Tensor  # its rows in the flattened batch (a slice when contiguous)
    blocks: torch.Tensor  # [B * max_blocks] block ids, padded with block 0
    max_blocks: int
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive: 0 real, -inf padding

    @property
    def size(self) -> int:
        return self.mask.shape[0]


@dataclass
class DecodeBatch:
    """Every single-query sequence of a step, for a kernel that reads the cache in place."""

    rows: slice  # their rows in the flattened batch (decode rows come first)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [B] int64
    # context ranges a split-K kernel divides each row into (the Triton backend's: a host
    # integer fixed per batch size, so that a CUDA graph keeps it)
    num_splits: int = 1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    sequences: list[SequenceSlice]  # multi-query sequences (prefill chunks)
    decode_sequences: list[SequenceSlice]
    decode_groups: list[DecodeGroup]
    block_size: int
    decode_batch: DecodeBatch | None = None  # for the backends that read it in place
    # the multi-query sequences as the Triton backend reads them (cuda/backend.py)
    prefill_batch: Any = None


class AttentionBackend(Protocol):
    # Whether the backend reads AttentionMetadata.decode_batch (else decode_groups).
    reads_decode_batch: bool

    def make_cache(self, num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key and value caches, laid out as this backend reads them."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [tokens, heads, head_dim]
        key: torch.Tensor,  # [tokens, kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # as make_cache made them
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = None,  # an FP8 cache's: written quantized, read dequantized
    ) -> torch.Tensor: ...


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    decode_batch: bool = False,
) -> AttentionMetadata:
    """Decode sequences listed in order of context length get contiguous rows per group,
    which saves a gather and a scatter of their queries per layer. Tensors are made on
    the slot mapping's device. `decode_batch`: describe the decode rows as one
    `DecodeBatch` (for a paged kernel) instead of padded groups."""
    device = slot_mapping.device
    sequences, decode, decode_tables = [], [], []
    row = 0
    for num_queries, context_len, blocks in zip(query_lens, context_lens, block_tables):
        if num_queries == 1 and decode_batch:
            decode_tables.append(blocks)
        table = torch.tensor(blocks, dtype=torch.long, device=device)
        seq = SequenceSlice(row, num_queries, context_len, table)
        (decode if num_queries == 1 else sequences).append(seq)
        row += num_queries
    if decode_batch:
        batch = _decode_batch(decode, decode_tables, device) if decode else None
        return AttentionMetadata(slot_mapping, sequences, decode, [], block_size, batch)
    groups = [_decode_group(g, block_size, dtype, device) for g in _group_by_length(decode)]
    return AttentionMetadata(slot_mapping, sequences, decode, groups, block_size)


def _decode_batch(
    decode: list[SequenceSlice], tables: list[list[int]], device: torch.device
) -> DecodeBatch:
    rows = [s.row_start for s in decode]
    if rows != list(range(rows[0], rows[0] + len(rows))):
        raise ValueError("attention: decode rows must be contiguous for a DecodeBatch")
    # At least two columns: a compiled graph takes the width as a dynamic size, which a
    # width of one would specialise.
    width = max(2, max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return DecodeBatch(
        rows=slice(rows[0], rows[0] + len(rows)),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device),
        context_lens=torch.tensor(
            [s.context_len for s in decode], dtype=torch.long, device=device
        ),  # fmt: skip
    )


def _group_by_length(decode: list[SequenceSlice]) -> list[list[SequenceSlice]]:
    """Padding every decode sequence to the longest one can double the KV copied per layer
    in a mixed batch; grouping sorted lengths bounds the padding to about a fifth."""
    groups: list[list[SequenceSlice]] = []
    for seq in sorted(decode, key=lambda s: s.context_len):
        if groups and seq.context_len <= 1.2 * groups[-1][0].context_len + 32:
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return groups


def _decode_group(
    seqs: list[SequenceSlice], block_size: int, dtype: torch.dtype, device: torch.device
) -> DecodeGroup:
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long, device=device)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    lengths = torch.tensor([s.context_len for s in seqs], device=device)
    positions = torch.arange(max_blocks * block_size, device=device)
    padding = (positions[None, :] >= lengths[:, None])[:, None, None, :]
    rows = [s.row_start for s in seqs]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeGroup(
        rows=slice(rows[0], rows[0] + len(rows))
        if contiguous
        else torch.tensor(rows, device=device),
        blocks=tables.flatten(),
        max_blocks=max_blocks,
        # Additive rather than boolean: SDPA converts a boolean mask on every call.
        mask=torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill_(
            padding, float("-inf")
        ),
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = None,
) -> None:
    k_cache, v_cache = kv_cache
    if kv_scales is not None:  # the cache's codes, copied as bytes (index_copy_ has no float8)
        key = quantize_kv(key, kv_scales[0], k_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, kv_scales[1], v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def dequantized(
    keys: torch.Tensor, values: torch.Tensor, kv_scales: KVScales, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values read from the cache, in `dtype` where the cache is FP8 (as is else)."""
    if kv_scales is None:
        return keys, values
    assert dtype is not None
    return dequantize_kv(keys, kv_scales[0], dtype), dequantize_kv(values, kv_scales[1], dtype)


def gather_context(cache: torch.Tensor, seq: SequenceSlice) -> torch.Tensor:
    """[context_len, kv_heads, dim] keys or values of one sequence."""
    return cache.index_select(0, seq.block_table).flatten(0, 1)[: seq.context_len]


class TorchPagedAttention:
    """Fast path: decode sequences in one padded SDPA call, the rest one call each."""

    reads_decode_batch = False

    def make_cache(self, num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return natural_cache(num_blocks, spec)

    def context(self, kv_cache, seq: SequenceSlice, kv_scales: KVScales = None,  # noqa: ANN001
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """[context_len, kv_heads, dim] keys and values of one sequence (an FP8 cache's
        dequantized into `dtype`)."""
        keys, values = gather_context(kv_cache[0], seq), gather_context(kv_cache[1], seq)
        return dequantized(keys, values, kv_scales, dtype)

    def forward(self, query, key, value, kv_cache, meta, scale, kv_scales=None):  # noqa: ANN001
        write_kv(key, value, kv_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(query)
        for group in meta.decode_groups:
            out[group.rows] = self._decode(query, kv_cache, group, scale, kv_scales)
        for seq in meta.sequences:
            rows = slice(seq.row_start, seq.row_start + seq.num_queries)
            out[rows] = self._sequence(query[rows], kv_cache, seq, scale, kv_scales)
        return out

    @staticmethod
    def _decode(query, kv_cache, group: DecodeGroup, scale, kv_scales=None) -> torch.Tensor:  # noqa: ANN001
        batch = group.size
        # index_select copies whole blocks: ~2.5x faster than advanced indexing here.
        keys = kv_cache[0].index_select(0, group.blocks)
        values = kv_cache[1].index_select(0, group.blocks)
        keys, values = dequantized(keys, values, kv_scales, query.dtype)
        keys = keys.view(batch, -1, *keys.shape[2:]).transpose(1, 2)  # [B, kv_heads, L, dim]
        values = values.view(batch, -1, *values.shape[2:]).transpose(1, 2)
        q = query[group.rows].unsqueeze(2)  # [B, heads, 1, dim]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    def _sequence(self, query, kv_cache, seq, scale, kv_scales=None) -> torch.Tensor:  # noqa: ANN001
        keys, values = self.context(kv_cache, seq, kv_scales, query.dtype)
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, queries, dim]
        num_cached = seq.context_len - seq.num_queries
        if num_cached == 0:
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            query_pos = torch.arange(num_cached, seq.context_len, device=q.device)
            mask = torch.arange(seq.context_len, device=q.device)[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)


# Batch-invariant attention: queries in tiles aligned to absolute positions, keys in
# fixed-size chunks aligned to position 0, combined by an online softmax in chunk order.
# Every matmul then has one fixed shape and a token always sits in the same tile row, so
# its result cannot depend on batch composition, chunking or prefix-cache hits. Masked
# scores are replaced (not added to) and contribute exact zeros.
QUERY_TILE = 16
KEY_CHUNK = 256


class BatchInvariantAttention:
    reads_decode_batch = False

    def make_cache(self, num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return natural_cache(num_blocks, spec)

    def forward(self, query, key, value, kv_cache, meta, scale, kv_scales=None):  # noqa: ANN001
        write_kv(key, value, kv_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(query)
        for seq in _all_sequences(meta):
            rows = slice(seq.row_start, seq.row_start + seq.num_queries)
            out[rows] = self._sequence(query[rows], kv_cache, seq, scale, kv_scales)
        return out

    def _sequence(self, query, kv_cache, seq, scale, kv_scales=None) -> torch.Tensor:  # noqa: ANN001
        heads = query.shape[1]
        keys, values = gather_context(kv_cache[0], seq), gather_context(kv_cache[1], seq)
        keys, values = dequantized(keys, values, kv_scales, query.dtype)
        keys = _padded_heads(keys, heads)  # [heads, Lp, dim]
        values = _padded_heads(values, heads)
        first_pos = seq.context_len - seq.num_queries
        lead = first_pos % QUERY_TILE
        total = lead + seq.num_queries
        q = query.new_zeros(total + (-total) % QUERY_TILE, *query.shape[1:])
        q[lead:total] = query
        positions = torch.arange(q.shape[0], device=q.device) + (first_pos - lead)
        positions = positions.clamp(max=seq.context_len - 1)  # padding rows: any valid row
        tiles = []
        for s in range(0, q.shape[0], QUERY_TILE):
            last = min(first_pos - lead + s + QUERY_TILE, seq.context_len) - 1  # host int
            tile = _attend_tile(q[s : s + QUERY_TILE], positions[s : s + QUERY_TILE], last,
                                keys, values, scale)  # fmt: skip
            tiles.append(tile)
        return torch.cat(tiles)[lead:total]


def _all_sequences(meta: AttentionMetadata) -> list[SequenceSlice]:
    return meta.sequences + meta.decode_sequences


def _padded_heads(context: torch.Tensor, heads: int) -> torch.Tensor:
    length = context.shape[0]
    padded = torch.cat([context, context.new_zeros((-length) % KEY_CHUNK, *context.shape[1:])])
    padded = padded.transpose(0, 1)  # [kv_heads, Lp, dim]
    return padded.repeat_interleave(heads // padded.shape[0], dim=0)


def _attend_tile(q, positions, last_pos: int, keys, values, scale) -> torch.Tensor:  # noqa: ANN001
    """`last_pos` = positions.max(), known on the host (no device sync per tile)."""
    q = q.transpose(0, 1).float()  # [heads, TILE, dim]
    num_chunks = last_pos // KEY_CHUNK + 1
    row_max = q.new_full((q.shape[0], QUERY_TILE, 1), float("-inf"))
    row_sum = q.new_zeros(q.shape[0], QUERY_TILE, 1)
    acc = q.new_zeros(q.shape[0], QUERY_TILE, q.shape[2])
    for c in range(num_chunks):
        k = keys[:, c * KEY_CHUNK : (c + 1) * KEY_CHUNK].float()
        v = values[:, c * KEY_CHUNK : (c + 1) * KEY_CHUNK].float()
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        key_pos = torch.arange(c * KEY_CHUNK, (c + 1) * KEY_CHUNK, device=q.device)
        scores = scores.masked_fill(
            key_pos[None, None, :] > positions[None, :, None], float("-inf")
        )
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        correction = torch.exp(row_max - new_max)
        probs = torch.exp(scores - new_max)
        row_sum = row_sum * correction + probs.sum(-1, keepdim=True)
        acc = acc * correction + torch.matmul(probs, v)
        row_max = new_max
    return (acc / row_sum).transpose(0, 1).to(keys.dtype)
