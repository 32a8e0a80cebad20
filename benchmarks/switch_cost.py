"""What the switch to new weights costs between two steps: copying the staged round into
the live weights (`double_buffer` off) against swapping a double buffer in (on).

An in-process `LLM` on the default model receives full rounds from a transformers copy of
the same checkpoint over ipc (the fastest backend: the trainer's weights sit in shared
memory). Only `finish_weight_update`, the commit that runs between two engine steps, is
timed (start and the updates, which run beside the steps in flight, are not); median and
best of `--rounds`, per dtype. Also printed: the whole round as the trainer sees it, and
the memory the engine holds besides its live weights (receive-buffer pool or shadow).

With `--tensor-parallel-size 2` the engine runs on two ranks, on the Qwen3-shaped model
benchmarks/tp.py writes (the default model's 9 heads do not split in two): the copy then
sends every tensor from rank 0 to the other rank at the commit, while with the double
buffer each rank writes its share into its own shadow during the updates and the commit
is a swap on every rank ("held MB": rank 0's).

    python benchmarks/switch_cost.py [--rounds 7] [--dtypes float32 bfloat16]
                                     [--tensor-parallel-size 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hotswap import LLM
from hotswap.default_model import default_model_dir
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
)


def rounds(llm: LLM, trainer: torch.nn.Module, count: int) -> tuple[list[float], list[float]]:
    """(commit seconds, whole-round seconds) per round."""
    client = InProcessWeightSyncClient(llm)
    sync = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(share_source=True), client, ModuleSource(trainer)
    )
    source = ModuleSource(trainer)
    metas, tensors = list(source.metadata()), [t for _, t in source]
    commits, totals = [], []
    for i in range(count + 1):  # the first round allocates: left out
        start = time.perf_counter()
        client.start_weight_update()
        sync.send_round(metas, tensors)
        before_commit = time.perf_counter()
        client.finish_weight_update(f"r{i}")
        end = time.perf_counter()
        if i:
            commits.append(end - before_commit)
            totals.append(end - start)
    sync.shutdown()
    return commits, totals


def held_bytes(llm: LLM) -> int:
    sync = llm.engine.weight_sync
    pool = sum(t.numel() * t.element_size() for t in sync._pool.values())
    shadow = sum(
        t.numel() * t.element_size() for t in (sync.shadow.shadow if sync.shadow else {}).values()
    )
    return pool + shadow


def main(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_dir()
    if args.tensor_parallel_size > 1:
        from tp import write_model  # benchmarks/tp.py's model

        from hotswap.default_model import cache_root

        path = write_model(cache_root() / "bench-models")
    print(f"{'dtype':<9} {'switch':<6} {'commit ms p50':>13} {'best':>7} {'round ms p50':>13} "
          f"{'held MB':>8}")  # fmt: skip
    for dtype in args.dtypes:
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        results = {}
        for switch in ("copy", "swap"):
            config = {"backend": "ipc", "double_buffer": switch == "swap"}
            llm = LLM(str(path), dtype=dtype, progress=False, weight_transfer_config=config,
                      tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
            commits, totals = rounds(llm, trainer, args.rounds)
            results[switch] = statistics.median(commits)
            commit, best = 1e3 * results[switch], 1e3 * min(commits)
            total, held = 1e3 * statistics.median(totals), held_bytes(llm) / 1e6
            print(f"{dtype:<9} {switch:<6} {commit:13.2f} {best:7.2f} {total:13.1f} {held:8.0f}")
            llm.shutdown()
        faster = results["copy"] / results["swap"]
        print(f"{dtype}: the swap commits {faster:.0f}x faster than the copy")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
