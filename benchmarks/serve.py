"""HTTP overhead of `hotswap serve`: N concurrent streaming clients against the server vs
the same workload through AsyncLLM in this process, side by side in one run.

Both sides run the engine core in its own process, so the ratio isolates what HTTP, JSON
and SSE cost. Prompts are fixed-length random token ids (no prefix sharing), greedy,
`ignore_eos`, so both sides generate exactly the same number of tokens. Prints tokens/s,
the ratio (server / AsyncLLM; target >= 0.9) and time to first token p50/p99.

With `--baseline SRC` (a source checkout of another commit, e.g. made by `git worktree add
/tmp/base COMMIT`) a second server is started from that checkout's code and both servers are
driven alternately: the ratio of the two HTTP rates shows what a change costs, the
machine's noise falling on both. `--text` sends text prompts, so tokenization is measured
as well.

    python benchmarks/serve.py [--model DIR] [--clients 32] [--max-tokens 64] [--rounds 2]
        [--dtype float32] [--text] [--baseline SRC]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from hotswap import AsyncLLM, RequestOutputKind, SamplingParams
from hotswap.config import read_hf_config, resolve_model_path


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


WORDS = "the policy samples a rollout while the trainer sends new weights to every engine"


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


def make_text_prompts(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS.split()) for _ in range(length)) for _ in range(count)]


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


async def run_http(url: str, model: str, prompts: list, max_tokens: int) -> RunResult:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(i: int, prompt: list[int] | str) -> tuple[int, float]:
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


def start_server(
    args: argparse.Namespace, source: str | None = None, extra: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`source`: run the server from that checkout's code instead of this one's."""
    cmd = [sys.executable, "-m", "hotswap", "serve", "--port", "0", "--log-level", "warning"]
    cmd += ["--served-model-name", "bench", "--dtype", args.dtype]
    cmd += (["--model", args.model] if args.model else []) + (extra or [])
    env = dict(os.environ, PYTHONPATH=os.path.abspath(source)) if source else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=source)
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
    vocab = read_hf_config(resolve_model_path(args.model))["vocab_size"]
    servers = [start_server(args)] + ([start_server(args, args.baseline)] if args.baseline else [])
    llm = None
    if not args.baseline:
        llm = AsyncLLM(args.model, dtype=args.dtype, multiprocess=True, progress=False)
    sides = _sides(args, llm, servers)
    best: dict[str, RunResult] = {}
    try:
        for run in sides.values():  # warm-up: one short pass each
            await run(_prompts(args, vocab, 99)[:4], 8)
        # Interleaved rounds, best of each: both sides see the same machine noise; the
        # order flips every round so neither always runs first.
        for round_index in range(args.rounds):
            prompts = _prompts(args, vocab, round_index)
            names = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for name in names:
                result = await sides[name](prompts, args.max_tokens)
                if name not in best or result.tokens_per_s > best[name].tokens_per_s:
                    best[name] = result
    finally:
        if llm is not None:
            llm.shutdown()
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
    kind = "text" if args.text else "token-id"
    print(f"{args.clients} streaming clients, {args.prompt_len}-{kind} prompts, "
          f"{args.max_tokens} tokens each, {args.dtype}, best of {args.rounds}")  # fmt: skip
    for name, result in best.items():
        report(name, result)
    first, second = (best[name].tokens_per_s for name in sides)
    target = "target >= 0.97" if args.baseline else "target >= 0.9"
    print(f"{' / '.join(sides)} throughput ratio: {first / second:.3f} ({target})")


def _sides(args: argparse.Namespace, llm: AsyncLLM | None, servers: list) -> dict:
    http = [lambda p, n, url=url: run_http(url, "bench", p, n) for _, url in servers]
    if args.baseline:
        return {"this tree (HTTP)": http[0], "baseline (HTTP)": http[1]}
    assert llm is not None
    return {
        "hotswap serve (HTTP)": http[0],
        "AsyncLLM (in process)": lambda p, n: run_engine(llm, p, n),
    }


def _prompts(args: argparse.Namespace, vocab: int, seed: int) -> list:
    if args.text:
        return make_text_prompts(args.clients, args.prompt_len, seed)
    return make_prompts(args.clients, args.prompt_len, vocab, seed)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (default: model's)")
    parser.add_argument("--text", action="store_true", help="text prompts (tokenized by each)")
    parser.add_argument("--baseline", default=None, help="checkout to compare the server with")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
