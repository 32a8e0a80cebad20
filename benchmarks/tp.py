"""Tensor parallelism on this machine: throughput with 1 and 2 ranks, and what a weight
round costs into a 2-rank engine, whole tensors against resharded (m2n) pushes.

The model (written once): a Qwen3-shaped dense model with random bf16 weights, hidden
1024, 8 layers, 16 query / 4 key-value heads of 64, intermediate 2816, vocabulary 32000
(untied head): 157M parameters, 314 MB.

- Throughput (greedy, EOS ignored, in-process `LLM`, alternating, best of `--repeats`):
  decode (8 requests, 16 prompt / 64 output tokens) and mixed (32 x 128 / 64). Both
  engines share the same cores: one rank gets every torch thread, two ranks half each.
- Rounds (bf16, every weight, best of `--rounds`): `ipc` whole tensors from one trainer
  (rank 0 receives everything and forwards every tensor whole to rank 1, which keeps its
  slice), and `m2n` from a trainer of 2 ranks holding FSDP-style dim-0 shards (threads of
  this process): each engine rank receives the pieces of its own slices only. Bytes are
  counted where they arrive.

    python benchmarks/tp.py [--repeats 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import random
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

WORKLOADS = {"decode": (8, 16, 64), "mixed": (32, 128, 64)}  # requests, prompt, output
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_model(root: Path) -> Path:
    import transformers

    from hotswap.config import resolve_model_path

    out = root / "qwen3-dense-1024x8"
    if (out / "model.safetensors").exists():
        return out
    config = transformers.Qwen3Config(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, intermediate_size=2816, tie_word_embeddings=False,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source := resolve_model_path(None) / name).exists():
            shutil.copy(source, out / name)
    return out


def tok_s(llm, workload: str) -> float:  # noqa: ANN001
    from hotswap import SamplingParams

    requests, prompt_len, output_len = WORKLOADS[workload]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 32000) for _ in range(prompt_len)]}
               for _ in range(requests)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == requests * output_len
    return requests * output_len / (time.perf_counter() - start)


def throughput(model_dir: Path, repeats: int) -> dict[str, float]:
    from hotswap import LLM

    engines = {f"TP={tp}": LLM(str(model_dir), tensor_parallel_size=tp, progress=False,
                               max_num_batched_tokens=4096) for tp in (1, 2)}  # fmt: skip
    for llm in engines.values():
        tok_s(llm, "decode")  # warm-up
    best: dict[str, float] = {}
    for _ in range(repeats):
        for workload in WORKLOADS:
            for name, llm in engines.items():
                key = f"{name}, {workload}"
                best[key] = max(best.get(key, 0.0), tok_s(llm, workload))
    for llm in engines.values():
        llm.shutdown()
    return best


def ipc_round(llm, tensors: dict[str, torch.Tensor]) -> float:  # noqa: ANN001
    from hotswap.weight_transfer import (
        InProcessWeightSyncClient,
        IPCTrainerInitInfo,
        TensorSource,
        WeightTransferTrainerFactory,
    )

    sender = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), InProcessWeightSyncClient(llm), TensorSource(sorted(tensors.items()))
    )
    start = time.perf_counter()
    sender.send_weights("ipc")
    return time.perf_counter() - start


def m2n_senders(llm, tensors: dict[str, torch.Tensor], trainers: int, engine_ranks: int) -> list:  # noqa: ANN001
    """Trainer ranks (threads) joined to the engine, each with its dim-0 shards."""
    from hotswap.weight_transfer import InProcessWeightSyncClient, WeightTransferTrainerFactory
    from hotswap.weight_transfer.m2n_trainer import M2NTrainerInitInfo, Shard, ShardedSource

    store = dist.TCPStore("127.0.0.1", 0, trainers, is_master=True, wait_for_workers=False)
    port = _free_port()
    senders: list = [None] * trainers

    def join(rank: int) -> None:
        own = dist.TCPStore("127.0.0.1", store.port, trainers, is_master=False)
        group = dist.ProcessGroupGloo(own, rank, trainers, datetime.timedelta(seconds=120))
        shards = []
        for name, t in sorted(tensors.items()):
            n = t.shape[0] // trainers
            shards.append(Shard(name, t[rank * n : (rank + 1) * n].clone(), tuple(t.shape), 0,
                                rank * n))  # fmt: skip
        info = M2NTrainerInitInfo(rank=rank, master_port=port, world_size=trainers + engine_ranks,
                                  num_trainer_ranks=trainers, trainer_group=group)  # fmt: skip
        client = InProcessWeightSyncClient(llm) if rank == 0 else None
        source = ShardedSource(shards)
        senders[rank] = WeightTransferTrainerFactory.trainer_init(info, client, source)

    _together([lambda r=r: join(r) for r in range(trainers)])
    return senders


def m2n_round(senders: list) -> float:
    start = time.perf_counter()
    _together([lambda s=s: s.send_weights("m2n") for s in senders])
    return time.perf_counter() - start


def _together(calls: list) -> None:
    threads = [threading.Thread(target=call) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rounds(model_dir: Path, count: int) -> list[tuple[str, float, float, float]]:
    """(path, best seconds, MiB into engine rank 0, MiB into rank 1) per path."""
    from safetensors.torch import load_file

    from hotswap import LLM

    tensors = load_file(str(model_dir / "model.safetensors"))
    whole = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    results = []
    for tp in (1, 2):
        llm = LLM(str(model_dir), tensor_parallel_size=tp, progress=False,
                  weight_transfer_config={"backend": "ipc"})  # fmt: skip
        best = min(ipc_round(llm, tensors) for _ in range(count))
        results.append((f"ipc whole tensors, 1 trainer rank -> TP={tp}", best, whole,
                        whole if tp == 2 else 0.0))  # fmt: skip
        llm.shutdown()
    llm = LLM(str(model_dir), tensor_parallel_size=2, progress=False,
              weight_transfer_config={"backend": "m2n"})  # fmt: skip
    senders = m2n_senders(llm, tensors, 2, 2)
    best = min(m2n_round(senders) for _ in range(count))
    rank0 = llm.engine.weight_sync.transfer.rank.bytes_received / count / 2**20
    sent = sum(s.bytes_sent for s in senders) / count / 2**20
    results.append(("m2n shards, 2 trainer ranks -> TP=2", best, rank0, sent - rank0))
    llm.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from hotswap.default_model import cache_root

    model_dir = write_model(cache_root() / "bench-models")
    best = throughput(model_dir, args.repeats)
    print(f"\nQwen3 shape 1024 x 8 layers, bf16, best of {args.repeats}")
    print("| engine, workload | tok/s | vs TP=1 |\n|---|---|---|")
    for name, value in best.items():
        print(f"| {name} | {value:.1f} | {value / best['TP=1, ' + name.split(', ')[1]]:.2f}x |")
    print(f"\n| weight round (bf16, every weight), best of {args.rounds} | s | MiB into rank 0 "
          "| MiB into rank 1 |\n|---|---|---|---|")  # fmt: skip
    for path, seconds, rank0, rank1 in rounds(model_dir, args.rounds):
        print(f"| {path} | {seconds:.3f} | {rank0:.1f} | {rank1:.1f} |")


if __name__ == "__main__":
    main()
