"""A sharded trainer updates a tensor-parallel engine, each engine rank receiving only its
slices (the `m2n` backend): no rank of either side ever holds a whole weight it does not own.

The trainer is 2 processes training the built-in SmolLM2-135M-Instruct with FSDP2
(`fully_shard` on gloo: every parameter a DTensor split on dim 0). The engine is `hotswap
serve --tensor-parallel-size 3` (the model's 9 query and 3 key/value heads split over 3
ranks; --load-format dummy: it starts from random weights). Each push moves every trainer
rank's shards straight to the engine ranks that hold the overlapping parts: 2 -> 3.

1. push the trainer's weights: the engine's gibberish becomes the model's answer;
2. one AdamW step (FSDP2) on a target sentence, push again: the engine's logprobs of that
   sentence equal the trainer's new ones.

    .venv/bin/python examples/rlhf_tp.py [--engine-ranks 3]
"""

from __future__ import annotations

import argparse
import os
import time

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _rlhf_http import PROMPT, complete, free_port, load_trainer_model, serve

from hotswap.rl import sharded_sender
from hotswap.weight_transfer import HTTPWeightSyncClient

TRAINER_RANKS = 2
TARGET = "The capital of France is Paris, a city on the Seine."


def fsdp_model() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = load_trainer_model().train()
    mesh = init_device_mesh("cpu", (TRAINER_RANKS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def target_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]


def engine_logprobs(url: str, name: str, ids: list[int]) -> torch.Tensor:
    body = {"model": name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    rows = answer["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([row[str(token)]["logprob"] for row, token in zip(rows, ids[1:])])


def push(sender, url: str, label: str) -> None:  # noqa: ANN001
    start, sent = time.perf_counter(), sender.bytes_sent
    committed = sender.send_weights(label)
    if committed is not None:
        seconds = time.perf_counter() - start
        mib = (sender.bytes_sent - sent) / 2**20
        print(f"pushed {label!r}: version {committed.version} in {seconds:.2f} s; trainer "
              f"rank 0 sent {mib:.1f} MiB of its shards")  # fmt: skip


def trainer(rank: int, url: str, name: str, engine_ranks: int, dist_port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
    dist.init_process_group("gloo", rank=rank, world_size=TRAINER_RANKS)
    torch.manual_seed(0)
    model = fsdp_model()
    # every rank: its shards, to the engine ranks holding their parts (rank 0 commits)
    sender = sharded_sender(model, HTTPWeightSyncClient(url), engine_ranks=engine_ranks)
    push(sender, url, "step-0")
    if rank == 0:
        text, spans = complete(url, name)
        print(f"trained weights: {PROMPT!r} -> {text!r}\n  weight_versions: {spans}")
    ids = torch.tensor([load_tokenizer().encode(TARGET)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = target_logprobs(model, ids).sum()
    (-before).backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = target_logprobs(model, ids)
    push(sender, url, "step-1")
    if rank == 0:
        served = engine_logprobs(url, name, ids[0].tolist())
        print(f"trainer logprob of the target: {before.item():.3f} -> {after.sum().item():.3f}")
        print(f"engine logprobs vs trainer's after the push: max |diff| "
              f"{(served - after).abs().max().item():.2e}")  # fmt: skip
    sender.shutdown()
    dist.destroy_process_group()


def load_tokenizer():  # noqa: ANN201
    from hotswap.default_model import default_model_dir
    from hotswap.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_dir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-ranks", type=int, default=3)
    args = parser.parse_args()
    extra = ["--tensor-parallel-size", str(args.engine_ranks), "--dtype", "float32"]
    with serve({"backend": "m2n"}, extra) as (name, url):
        print(f"server: {name} at {url}, {args.engine_ranks} tensor-parallel ranks")
        text, _ = complete(url, name)
        print(f"random weights: {PROMPT!r} -> {text!r}")
        mp.spawn(trainer, args=(url, name, args.engine_ranks, free_port()),
                 nprocs=TRAINER_RANKS)  # fmt: skip


if __name__ == "__main__":
    main()
