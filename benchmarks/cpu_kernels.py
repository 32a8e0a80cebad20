"""hotswap's CPU kernels against the torch operators they replace, side by side in one run,
on the default model's shapes (bf16):

- linear layers of one decode step (all 30 layers' q/k/v/o/gate_up/down + the LM head):
  hotswap's GEMV vs F.linear at 1-8 rows, and the oneDNN-packed copy vs F.linear at 16-128
  rows; the GEMV's effective weight bandwidth against this machine's copy bandwidth (the
  roofline's measure in vs_vllm.py);
- paged decode attention over every layer's cache (64 sequences, mixed context lengths):
  hotswap's kernel reading blocks in place (the tiled bf16 cache where the CPU has
  AVX-512 BF16) vs the engine's torch path (sequences grouped
  by length, an index_select gather + SDPA per group) and vs that gather alone (the copy
  the kernel avoids).

Inputs are laid out so each pass reads from DRAM (weights and caches larger than the
last-level cache), as a real decode step does.

    python benchmarks/cpu_kernels.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from vs_vllm import read_bandwidth_gbps  # the roofline's measure: one definition

from hotswap.model.attention import CacheSpec, TorchPagedAttention, build_metadata, write_kv
from hotswap.model.attention_kernel import PagedKernelAttention
from hotswap.model.kernels import CpuKernels
from hotswap.model.packed import TILES_MAX_ROWS, PackedWeight, can_pack, packed_copy, tiles_apply

# SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, 30 layers, vocab 49152.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, VOCAB = 576, 9, 3, 64, 1536, 30, 49152
BLOCK = 16


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def step_weights() -> list[torch.Tensor]:
    """One decode step's linear weights, [out, in] bf16, in layer order."""
    shapes = [(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN),
              (2 * MLP, HIDDEN), (HIDDEN, MLP)] * LAYERS + [(VOCAB, HIDDEN)]  # fmt: skip
    return [torch.randn(shape, dtype=torch.bfloat16) * 0.02 for shape in shapes]


def bench_linear(kernels: CpuKernels, repeats: int) -> None:
    weights = step_weights()
    nbytes = sum(w.numel() * 2 for w in weights)
    # oneDNN's packed copies alone, and the engine's (AMX tiles too, where they apply)
    onednn = [PackedWeight() for _ in weights] if can_pack() else None
    engine = [packed_copy(w, kernels) for w in weights] if can_pack() else None
    amx = engine is not None and all(tiles_apply(kernels, w) for w in weights)
    print(f"\nlinear layers of one step ({nbytes / 1e6:.0f} MB of bf16 weights); "
          f"copy bandwidth {read_bandwidth_gbps():.1f} GB/s")  # fmt: skip
    print(f"{'rows':>5} {'F.linear ms':>12} {'oneDNN packed ms':>17} {'hotswap ms':>11} "
          f"{'speed-up':>9} {'path':>8} {'GB/s':>6}")  # fmt: skip

    def run(rows: int, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> float:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.bfloat16)
                  for w in weights}  # fmt: skip
        return best_seconds(
            lambda: [fn(inputs[w.shape[1]], i) for i, w in enumerate(weights)], repeats
        )

    for rows in (1, 2, 4, 8, 16, 32, 48, 64, 128):
        base = run(rows, lambda x, i: F.linear(x, weights[i]))
        if onednn is None:
            continue
        library = run(rows, lambda x, i: onednn[i].linear(x, weights[i], None))
        if rows <= 8:
            ours, path = run(rows, lambda x, i: kernels.gemv(x, weights[i])), "GEMV"
        else:
            ours = run(rows, lambda x, i: engine[i].linear(x, weights[i], None))
            path = "AMX" if amx and rows <= TILES_MAX_ROWS else "oneDNN"
        print(f"{rows:5d} {1000 * base:12.2f} {1000 * library:17.2f} {1000 * ours:11.2f} "
              f"{base / ours:8.2f}x {path:>8} {nbytes / ours / 1e9:6.1f}")  # fmt: skip


def bench_attention(kernels: CpuKernels, repeats: int, batch: int) -> None:
    """One decode step's attention through the engine's two backends: the torch path
    (sequences grouped by context length, each group's blocks gathered with index_select,
    one SDPA call per group) and hotswap's kernel; plus the gather alone."""
    rng = random.Random(0)
    context = [rng.randint(32, 768) for _ in range(batch)]
    counts = [-(-c // BLOCK) for c in context]
    order = list(range(1, sum(counts) + 1))
    rng.shuffle(order)  # blocks scattered over the cache, as after churn
    tables, cursor = [], 0
    for count in counts:
        tables.append(order[cursor : cursor + count])
        cursor += count
    slots = torch.tensor([t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK
                          for t, c in zip(tables, context)])  # fmt: skip
    shape = (sum(counts) + 1, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
              for _ in range(LAYERS)]  # fmt: skip
    query = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    key = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    ones = [1] * batch
    grouped = build_metadata(ones, context, tables, slots, BLOCK, torch.bfloat16)
    paged = build_metadata(ones, context, tables, slots, BLOCK, torch.bfloat16, True)
    torch_backend = TorchPagedAttention()
    kernel_backend = PagedKernelAttention(kernels)
    spec = CacheSpec(BLOCK, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
    all_slots = torch.arange(shape[0] * BLOCK)
    kernel_caches = []  # the same contents, in the layout the kernel reads (tiled here)
    for k, v in caches:
        made = kernel_backend.make_cache(shape[0], spec)
        if kernel_backend.tiled:
            kernels.write_kv_tiles(k.flatten(0, 1), v.flatten(0, 1), *made, all_slots)
        else:
            write_kv(k.flatten(0, 1), v.flatten(0, 1), made, all_slots)
        kernel_caches.append(made)
    scale = HEAD_DIM**-0.5
    kv_bytes = sum(context) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2

    def step(backend: object, meta: object, layers: list) -> Callable[[], None]:
        return lambda: [backend.forward(query, key, key, kv, meta, scale) for kv in layers]

    def gather_only() -> None:
        for k, v in caches:
            for group in grouped.decode_groups:
                k.index_select(0, group.blocks), v.index_select(0, group.blocks)

    print(f"\npaged decode attention, {LAYERS} layers, {batch} sequences of 32-768 tokens "
          f"(mean {sum(context) / batch:.0f}; {kv_bytes / 1e6:.0f} MB of K/V; torch path in "
          f"{len(grouped.decode_groups)} length groups)")  # fmt: skip
    ours = best_seconds(step(kernel_backend, paged, kernel_caches), repeats)
    runs = (("torch path", step(torch_backend, grouped, caches)), ("its gather alone", gather_only))
    for name, fn in runs:
        theirs = best_seconds(fn, repeats)
        print(f"  {name:<16} {1000 * theirs:8.1f} ms   hotswap kernel {1000 * ours:6.1f} ms "
              f"({theirs / ours:.2f}x)")  # fmt: skip
    layout = "tiled" if kernel_backend.tiled else "natural"
    print(f"  kernel ({layout} cache) reads K/V at {kv_bytes / ours / 1e9:.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="sequences for attention")
    args = parser.parse_args()
    kernels = CpuKernels.load()
    if kernels is None:
        raise SystemExit("hotswap's CPU kernels cannot be built on this machine")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        bench_linear(kernels, args.repeats)
        bench_attention(kernels, args.repeats, args.batch)


if __name__ == "__main__":
    main()
