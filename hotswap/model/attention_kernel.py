"""Decode attention through hotswap's paged CPU kernels, which read each sequence's keys
and values where they lie in the cache; prefill chunks go through SDPA as in the torch path.

Where the tiled kernel applies (bf16, head size 64 or 128, AVX-512 BF16), the cache is kept
in 16-position tiles per kv head, laid out for BF16 dot products (see
csrc/paged_attention_tiles.cpp): a decode step reads them as they are, at ~1.2-1.4x the
natural layout's speed; new tokens are written into their tiles, and a prefill chunk with
cached context has the tiles rearranged into rows for SDPA. An FP8 cache under bf16
queries (--kv-cache-dtype fp8, fp8_e5m2) is tiled too: new tokens are quantized, their codes
written into the tiles, and the kernel widens the codes as it reads them. Elsewhere the
cache keeps the natural [blocks, block_size, kv_heads, dim] layout and the portable kernel,
which reads e4m3 and e5m2 codes as well.
"""

from __future__ import annotations

import torch

from hotswap.model.attention import (
    CacheSpec,
    DecodeBatch,
    KVScales,
    SequenceSlice,
    TorchPagedAttention,
    dequantized,
    natural_cache,
    write_kv,
)
from hotswap.model.kernels import CpuKernels
from hotswap.model.kv_fp8 import is_fp8_kv, quantize_kv

TILE = 16  # positions per tile


def tiled_cache(num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, kv_heads, block_size / 16, 16 * head_dim] keys and values, zeroed."""
    shape = (num_blocks, spec.num_kv_heads, spec.block_size // TILE, TILE * spec.head_dim)
    return tuple(torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(2))


def untile(
    k_tiles: torch.Tensor, v_tiles: torch.Tensor, seq: SequenceSlice
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's [context_len, kv_heads, dim] keys and values, out of its tiles (key
    tile [dim/2][16][2], value tile [8][dim][2]: see csrc/paged_attention_tiles.cpp)."""
    if is_fp8_kv(k_tiles.dtype):  # codes moved as bytes (index_select has no float8)
        keys, values = untile(k_tiles.view(torch.uint8), v_tiles.view(torch.uint8), seq)
        return keys.view(k_tiles.dtype), values.view(v_tiles.dtype)
    blocks, kv_heads, tiles, size = k_tiles.shape
    dim, n = size // TILE, len(seq.block_table)
    keys = k_tiles.index_select(0, seq.block_table).view(n, kv_heads, tiles, dim // 2, TILE, 2)
    keys = keys.permute(0, 2, 4, 1, 3, 5).reshape(n * tiles * TILE, kv_heads, dim)
    values = v_tiles.index_select(0, seq.block_table).view(n, kv_heads, tiles, TILE // 2, dim, 2)
    values = values.permute(0, 2, 3, 5, 1, 4).reshape(n * tiles * TILE, kv_heads, dim)
    return keys[: seq.context_len], values[: seq.context_len]


class PagedKernelAttention(TorchPagedAttention):
    reads_decode_batch = True

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self.tiled = False  # decided with the cache, by make_cache

    def make_cache(self, num_blocks: int, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        self.tiled = self.kernels.tiles_apply(spec.dtype, spec.num_heads, spec.num_kv_heads,
                                              spec.head_dim, spec.block_size,
                                              spec.compute_dtype)  # fmt: skip
        return (tiled_cache if self.tiled else natural_cache)(num_blocks, spec)

    def context(self, kv_cache, seq: SequenceSlice, kv_scales: KVScales = None,  # noqa: ANN001
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if self.tiled:
            return dequantized(*untile(*kv_cache, seq), kv_scales, dtype)
        return super().context(kv_cache, seq, kv_scales, dtype)

    def forward(self, query, key, value, kv_cache, meta, scale, kv_scales=None):  # noqa: ANN001
        if self.tiled:
            if kv_scales is not None:  # an FP8 cache: the codes go into the tiles
                codes = kv_cache[0].dtype
                key = quantize_kv(key, kv_scales[0], codes)
                value = quantize_kv(value, kv_scales[1], codes)
            self.kernels.write_kv_tiles(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)
        else:
            write_kv(key, value, kv_cache, meta.slot_mapping, kv_scales)
        batch = meta.decode_batch
        if batch is not None and not meta.sequences:  # a pure decode step: one call
            return self._decode(query, kv_cache, batch, scale, kv_scales)
        out = query.new_empty(query.shape)
        if batch is not None:
            out[batch.rows] = self._decode(query[batch.rows], kv_cache, batch, scale, kv_scales)
        for seq in meta.sequences:
            rows = slice(seq.row_start, seq.row_start + seq.num_queries)
            out[rows] = self._sequence(query[rows], kv_cache, seq, scale, kv_scales)
        return out

    def _decode(self, query, kv_cache, batch: DecodeBatch, scale, kv_scales=None) -> torch.Tensor:  # noqa: ANN001
        keys, values = kv_cache
        tables, lens = batch.block_tables, batch.context_lens
        # the scales always passed: Inductor's C++ wrapper leaves defaulted arguments out of
        # the call, which the dispatcher then refuses
        k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
        decode = (self.kernels.paged_decode_attention_tiles if self.tiled
                  else self.kernels.paged_decode_attention)  # fmt: skip
        return decode(query, keys, values, tables, lens, scale, k_scale, v_scale)
