"""hotswap on Ray against hotswap's own scale-out, side by side on this machine (default
model, float32, two engines, one torch thread each):

1. weight sync: one trainer (this process, the real model loaded by transformers) sends
   every weight to two engines with a two-phase commit, best of `--rounds`:
   - `EngineGroup` over HTTP to two `hotswap serve` processes, gloo (the reference);
   - `RayEngineGroup` over two engine actors, gloo (target: ratio >= 0.9);
   - `RayEngineGroup`, the `ray` backend (the object store), with its bandwidth as a
     fraction of this machine's memcpy (bytes sent once).
2. generation throughput: `--requests` token-id prompts (greedy, EOS ignored) through two
   engine actors (`RayEngineGroup.generate`) vs `AsyncLLM(data_parallel_size=2)` with the
   process backend (target: ratio >= 0.9).

    python benchmarks/ray_scaleout.py [--rounds 3] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
import torch
from serve import start_server
from weight_sync import free_port, load_trainer, memcpy_gbps

from hotswap import AsyncLLM, SamplingParams
from hotswap.default_model import default_model_dir
from hotswap.ray import RayEngineGroup, RayTrainerInitInfo, launch_engines
from hotswap.rl import EngineGroup
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

GLOO = {"backend": "gloo"}
RAY = {"backend": "ray"}


def trainer_for(group: EngineGroup, trainer: torch.nn.Module, info: object = None) -> Any:
    info = info or GlooTrainerInitInfo(master_port=free_port(), world_size=1 + group.num_workers)
    return WeightTransferTrainerFactory.trainer_init(info, group, ModuleSource(trainer))


def one_round(sync: Any, label: str) -> float:
    start = time.perf_counter()
    sync.send_weights(label)
    seconds = time.perf_counter() - start
    sync.client.check_consistent()  # every engine holds the same weights
    return seconds


@contextlib.contextmanager
def http_engines(args: argparse.Namespace) -> Iterator[list[str]]:
    flags = [
        "--enable-control",
        "--num-threads",
        "1",
        "--weight-transfer-config",
        '{"backend": "gloo"}',
    ]
    servers = [start_server(args, extra=flags) for _ in range(2)]
    try:
        yield [url for _, url in servers]
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)


@contextlib.contextmanager
def actors(config: dict) -> Iterator[RayEngineGroup]:
    engines = launch_engines(2, engine_args={"dtype": "float32", "weight_transfer_config": config})
    group = RayEngineGroup(engines)
    try:
        yield group
    finally:
        group.close()
        engines.shutdown()


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 40000) for _ in range(rng.randrange(16, 128))] for _ in range(count)]


def ray_throughput(group: RayEngineGroup, batch: list, params: SamplingParams) -> float:
    group.generate(batch[:2], params)  # warm-up
    start = time.perf_counter()
    outputs = group.generate(batch, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


class ProcessBackend:
    """`AsyncLLM(data_parallel_size=2)`, its engine cores in child processes."""

    def __init__(self) -> None:
        self.llm = AsyncLLM(None, multiprocess=True, data_parallel_size=2, dtype="float32",
                            num_threads=1)  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.runs = 0

    def throughput(self, batch: list, params: SamplingParams) -> float:
        return self.loop.run_until_complete(self._measure(batch, params))

    async def _run(self, items: list, params: SamplingParams) -> int:
        self.runs += 1

        async def one(i: int, prompt: list[int]) -> int:
            final = None
            async for final in self.llm.generate(prompt, params, f"r{self.runs}-{i}"):  # noqa: B007
                pass
            return len(final.outputs[0].token_ids)

        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(items))))

    async def _measure(self, batch: list, params: SamplingParams) -> float:
        await self._run(batch[:2], params)  # warm-up
        start = time.perf_counter()
        tokens = await self._run(batch, params)
        return tokens / (time.perf_counter() - start)

    def close(self) -> None:
        self.llm.shutdown()
        self.loop.close()


def alternate(rounds: int, sides: dict[str, Callable[[], float]], best: Callable) -> dict:
    """Each side once per round, in turn; each side's best value."""
    values: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, measure in sides.items():
            values[name].append(measure())
            print(f"  {name}: {values[name][-1]:.3f}", flush=True)
    return {name: best(v) for name, v in values.items()}


def main(args: argparse.Namespace) -> None:
    trainer = load_trainer(default_model_dir())
    nbytes = sum(meta.nbytes for meta in ModuleSource(trainer).metadata())  # as sent
    memcpy = memcpy_gbps()[0]
    print(f"default model: {nbytes / 1e6:.0f} MB float32; memcpy {memcpy:.2f} GB/s")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print("weight sync, seconds per round (alternating; best counts):")
    with http_engines(args) as urls, actors(GLOO) as on_ray:
        over_http = EngineGroup([HTTPWeightSyncClient(u) for u in urls])
        syncs = {
            "http-gloo": trainer_for(over_http, trainer),
            "ray-gloo": trainer_for(on_ray, trainer),
        }
        sync = alternate(
            args.rounds, {k: lambda s=s: one_round(s, "r") for k, s in syncs.items()}, min
        )
        for s in syncs.values():
            s.shutdown()
        over_http.close()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.requests)
    with actors(RAY) as on_ray:
        store = trainer_for(on_ray, trainer, RayTrainerInitInfo())
        sync.update(alternate(args.rounds, {"ray-backend": lambda: one_round(store, "r")}, min))
        processes = ProcessBackend()
        print("generation, tok/s (alternating; best counts):")
        speed = alternate(
            2,
            {
                "ray-actors": lambda: ray_throughput(on_ray, batch, params),
                "dp-processes": lambda: processes.throughput(batch, params),
            },
            max,
        )
        processes.close()
    ray.shutdown()
    report(sync, speed, nbytes, memcpy)


def report(sync: dict, speed: dict, nbytes: int, memcpy: float) -> None:
    gbps = nbytes / sync["ray-backend"] / 1e9
    print("ratios:")
    print(
        f"  weight sync, Ray group vs EngineGroup over HTTP (gloo): "
        f"{sync['http-gloo'] / sync['ray-gloo']:.2f}x (target >= 0.9)"
    )
    store = sync["http-gloo"] / sync["ray-backend"]
    print(f"  weight sync, ray backend vs gloo over HTTP: {store:.2f}x")
    print(f"  ray backend bandwidth: {gbps:.2f} GB/s = {gbps / memcpy:.0%} of memcpy")
    print(
        f"  generation, two engine actors vs DP=2 processes: "
        f"{speed['ray-actors'] / speed['dp-processes']:.2f}x (target >= 0.9)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None)
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
