"""HTTP overhead of `hotswap serve`: N concurrent streaming clients against the server vs
the same workload through AsyncLLM in this process, side by side in one run.

Both sides run the engine core in its own process, so the ratio isolates what HTTP, JSON
and SSE cost. Prompts are fixed-length random token ids (no prefix sharing), greedy,
`ignore_eos`, so both sides generate exactly the same number of tokens. Prints tokens/s,
the ratio (server / AsyncLLM; target >= 0.9) and time to first token p50/p99.

    python benchmarks/serve.py [--model DIR] [--clients 32] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from hotswap import AsyncLLM, RequestOutputKind, SamplingParams


@dataclass
class RunResult:
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


async def run_engine(llm: AsyncLLM, prompts: list[list[int]], max_tokens: int) -> RunResult:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(i: int, prompt: list[int]) -> tuple[int, float]:
        start, first, count = time.perf_counter(), None, 0
        async for out in llm.generate({"prompt_token_ids": prompt}, params, f"b{i}"):
            first = first or time.perf_counter() - start
            count += len(out.outputs[0].token_ids)
        return count, first or 0.0

    return await _timed(one, prompts)


async def run_http(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> RunResult:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(i: int, prompt: list[int]) -> tuple[int, float]:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start, first, count = time.perf_counter(), None, 0
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        first = first or time.perf_counter() - start
                    if chunk.get("usage"):
                        count = chunk["usage"]["completion_tokens"]
            return count, first or 0.0

        return await _timed(one, prompts)


async def _timed(one, prompts: list[list[int]]) -> RunResult:  # noqa: ANN001
    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    return RunResult(sum(r[0] for r in results), seconds, [r[1] for r in results])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hotswap", "serve", "--port", "0", "--log-level", "warning"]
    cmd += ["--served-model-name", "bench"] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if " at http://" in line:
            return proc, line.rsplit(" at ", 1)[1].strip()
    raise RuntimeError("server did not start")


def report(name: str, result: RunResult) -> None:
    print(
        f"{name:<22} {result.tokens_per_s:8.1f} tok/s  ({result.tokens} tokens in "
        f"{result.seconds:.2f} s)  TTFT p50 {1000 * statistics.median(result.ttft):7.1f} ms"
        f"  p99 {1000 * percentile(result.ttft, 0.99):7.1f} ms"
    )


async def main(args: argparse.Namespace) -> None:
    llm = AsyncLLM(args.model, multiprocess=True, progress=False)
    vocab = llm.config.model.vocab_size
    proc, url = start_server(args)
    best: dict[str, RunResult] = {}
    try:
        warm = make_prompts(4, args.prompt_len, vocab, seed=99)
        await run_engine(llm, warm, 8)
        await run_http(url, "bench", warm, 8)
        # Interleaved rounds, best of each: both sides see the same machine noise.
        for round_index in range(args.rounds):
            prompts = make_prompts(args.clients, args.prompt_len, vocab, seed=round_index)
            runs = {
                "AsyncLLM (in process)": run_engine(llm, prompts, args.max_tokens),
                "hotswap serve (HTTP)": run_http(url, "bench", prompts, args.max_tokens),
            }
            for name, run in runs.items():
                result = await run
                if name not in best or result.tokens_per_s > best[name].tokens_per_s:
                    best[name] = result
    finally:
        llm.shutdown()
        proc.terminate()
        proc.wait(30)
    print(f"{args.clients} streaming clients, {args.prompt_len}-token prompts, "
          f"{args.max_tokens} tokens each, best of {args.rounds}")  # fmt: skip
    for name, result in best.items():
        report(name, result)
    ratio = best["hotswap serve (HTTP)"].tokens_per_s / best["AsyncLLM (in process)"].tokens_per_s
    print(f"HTTP / in-process throughput ratio: {ratio:.3f} (target >= 0.9)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
