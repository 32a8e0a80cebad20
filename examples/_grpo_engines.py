"""The GRPO recipe's rollout engines (examples/grpo_async.py `--engine`): hotswap in
process (`AsyncLLM`, its engine core in a child process), over HTTP (`hotswap serve`), or
as Ray actors (`hotswap.ray`). Each hands the trainer the engine's sampled tokens, their
processed logprobs and their weight versions, and a weight-sync client to push with."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weight_transfer import (
    HTTPWeightSyncClient,
    InProcessWeightSyncClient,
    WeightSyncClient,
)


@dataclass
class Completion:
    """One sampled completion, as the trainer needs it."""

    token_ids: list[int]
    logprobs: list[float]  # the engine's processed logprob of each sampled token
    versions: list[int]  # the weight version that produced each token
    text: str


class Loop(Protocol):
    """The recipe's event-loop thread: runs a coroutine there and waits for it."""

    def run(self, coro: Any) -> Any: ...


class RolloutEngine(Protocol):
    weight_client: WeightSyncClient

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of one prompt."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    def close(self) -> None: ...


def in_flight_config(args: argparse.Namespace) -> dict[str, Any]:
    """--in-flight: rounds are received beside the steps into a second copy of the weights
    (double buffer) and swapped in between two steps; the requests running across the
    switch recompute their KV under the new weights, so their later tokens are exactly on
    the new policy (not stale)."""
    if not args.in_flight:
        return {}
    return {"in_flight": True, "kv_policy": "recompute", "double_buffer": True}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype,
        "lm_head_dtype": args.lm_head_dtype,
        "num_threads": args.engine_threads,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": args.transport, **in_flight_config(args)},
        "seed": args.seed,
    }


class InProcessEngine:
    """`AsyncLLM` with its engine core in a child process (so it can have its own cores)."""

    def __init__(self, args: argparse.Namespace, loop: Loop) -> None:
        from hotswap import AsyncLLM

        self.llm = AsyncLLM(multiprocess=True, progress=False, **engine_options(args))
        loop.run(self.llm.get_weight_info())  # starts the front-end on the loop thread
        self.weight_client = InProcessWeightSyncClient(self.llm)
        self.ids = iter(range(1 << 62))

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        request_id = f"r{next(self.ids)}"
        async for partial in self.llm.generate(prompt_ids, params, request_id=request_id):
            out = partial  # cumulative: the last one is the whole completion
        return completions(out)

    async def pause(self) -> None:
        # keep: requests in flight are frozen, not aborted; clear_cache: they recompute
        # their KV on the new weights, so tokens after the push are exactly on-policy.
        await self.llm.pause_generation(mode="keep", clear_cache=True)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def close(self) -> None:
        self.llm.shutdown()


class HTTPEngine:
    """`hotswap serve` over its OpenAI API and RL control plane."""

    def __init__(self, url: str, loop: Loop) -> None:
        import httpx

        self.loop = loop
        self.weight_client = HTTPWeightSyncClient(url)
        self.http = loop.run(_async_client(httpx, url))
        self.model = loop.run(self.http.get("/v1/models")).json()["data"][0]["id"]

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        body = {
            "model": self.model, "prompt": prompt_ids, "n": params.n,
            "temperature": params.temperature, "top_p": params.top_p,
            "max_tokens": params.max_tokens, "seed": params.seed, "logprobs": 0,
            "return_token_ids": True,
        }  # fmt: skip
        response = await self.http.post("/v1/completions", json=body)
        response.raise_for_status()
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [
            Completion(
                c["token_ids"],
                c["logprobs"]["token_logprobs"],
                unroll(c["weight_versions"], len(c["token_ids"])),
                c["text"],
            )
            for c in choices
        ]

    async def pause(self) -> None:
        r = await self.http.post("/pause", params={"mode": "keep", "clear_cache": "true"})
        r.raise_for_status()

    async def resume(self) -> None:
        (await self.http.post("/resume")).raise_for_status()

    def close(self) -> None:
        self.weight_client.close()
        self.loop.run(self.http.aclose())


class RayEngine:
    """Engine actors on a local Ray (`--ray-engines` of them, `--engine-threads` CPUs
    each); prompts go to them in turn, pauses and pushes reach all (`RayEngineGroup`, a
    two-phase commit across them)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        from hotswap.ray import RayEngineGroup, launch_engines

        self.ray = ray
        threads = args.engine_threads
        ray.init(num_cpus=threads * args.ray_engines, include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
        self.engines = launch_engines(
            args.ray_engines, engine_args=engine_options(args), num_cpus_per_engine=threads
        )
        self.weight_client = RayEngineGroup(self.engines)
        self.turn = itertools.count()

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        actor = self.engines[next(self.turn) % len(self.engines)]
        return completions(await actor.generate.remote(prompt_ids, params))

    async def pause(self) -> None:
        await asyncio.gather(*(a.call.remote("pause", mode="keep", clear_cache=True)
                               for a in self.engines))  # fmt: skip

    async def resume(self) -> None:
        await asyncio.gather(*(a.call.remote("resume") for a in self.engines))

    def close(self) -> None:
        self.weight_client.close()
        self.engines.shutdown()
        self.ray.shutdown()


def completions(out: RequestOutput) -> list[Completion]:
    """A finished request's completions, in index order."""
    return [
        Completion(
            list(c.token_ids),
            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
            c.token_versions,
            c.text,
        )
        for c in sorted(out.outputs, key=lambda c: c.index)
    ]


async def _async_client(httpx: Any, url: str) -> Any:
    return httpx.AsyncClient(base_url=url, timeout=600.0)


def unroll(spans: list[dict[str, Any]], length: int) -> list[int]:
    """Per-token versions from the response's weight-version spans."""
    versions = [0] * length
    for span in spans:
        versions[span["start"] : span["end"]] = [span["version"]] * (span["end"] - span["start"])
    return versions


@contextlib.contextmanager
def hotswap_server(args: argparse.Namespace) -> Iterator[str]:
    """`hotswap serve` as a child process; its weights come with the first push."""
    from _rlhf_http import serve  # examples/: the server plumbing of the rlhf_http examples

    options = engine_options(args)
    extra = ["--dtype", args.dtype, "--num-threads", str(args.engine_threads),
             "--logprobs-mode", options["logprobs_mode"], "--seed", str(args.seed)]  # fmt: skip
    if args.lm_head_dtype:
        extra += ["--lm-head-dtype", args.lm_head_dtype]
    with serve(options["weight_transfer_config"], extra) as (_, url):
        yield url
