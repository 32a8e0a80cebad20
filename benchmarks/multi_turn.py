"""Multi-turn agent sessions on data-parallel ranks: how `--dp-routing` keeps a session's
KV where its next turn goes.

`--sessions` concurrent sessions of `--turns` turns each on the default model (or
`--model`), `--data-parallel-size` engine cores. Each session starts from its own task and
document (`--document-words` random words) after a system prompt every session shares,
and resends its whole growing context every turn (its previous prompt, the model's answer,
a tool result of `--tool-words` words), as an agent's rollout does; between turns it waits
for its "tool" (`--tool-s`, scaled by a seeded random factor per turn, so that sessions
fall out of step). One engine per policy, run one after the
other in this process:

- least-loaded: no session key; each turn goes to the rank with the fewest unfinished
  requests (hotswap's behaviour before `--dp-routing`, and vLLM's);
- session: each turn carries its session's key (`X-Session-ID` over HTTP, `session_id`
  here), so it goes to the rank that served the session's earlier turns;
- cache-aware: no session key; each turn goes to the rank whose cache holds the longest
  prefix of its prompt (as the front end has routed them), balanced against load.

With `--servers N` the same sessions also run over HTTP against N `hotswap serve` processes
(one engine thread each) behind `hotswap route`, one router per policy (`--dp-routing`),
each turn a /v1/completions request of the whole context's token ids (a session's turns
carry `X-Session-ID` under the session policy); caches are reset between policies.

Per policy: `hit %`, the share of later turns' (turn 2 on) prompt tokens served from the
prefix cache; `turn ms`, the mean time from a turn's submission to its last token;
`tok/s`, generated tokens per second over the run (tool waits included); `moves`, session
turns spilled off an overloaded rank; `routed`, requests per rank (one warm-up request
per rank included).

    python benchmarks/multi_turn.py [--sessions 12] [--turns 4] [--max-tokens 32]
        [--tool-s 0.05] [--policies least-loaded session cache-aware] [--servers 2]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from hotswap import AsyncLLM, SamplingParams
from hotswap.default_model import default_model_dir
from hotswap.tokenizer import Tokenizer

SYSTEM = (
    "You are an agent that solves tasks with tools. Think step by step, call one tool "
    "per turn, and answer when you are done. "
) * 4
TASKS = [
    "find the population of the capital of {n} and double it",
    "list {n} prime numbers greater than one hundred",
    "compute the sum of the first {n} square numbers",
    "plan a trip through {n} cities and estimate its cost",
]


@dataclass
class Result:
    policy: str
    hit_rate: float
    turn_ms: float
    tokens_per_s: float
    moves: int
    routed: list[int]


VOCABULARY = ("data", "value", "table", "city", "price", "total", "report", "step", "result",
              "error", "file", "query", "agent", "number", "answer", "sum")  # fmt: skip


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


async def run_session(llm: AsyncLLM, args: argparse.Namespace, s: int, keyed: bool) -> tuple:
    """One session: (cached, prompt tokens of turns 2.., turn times, generated tokens)."""
    rng = random.Random(s)
    task = TASKS[s % len(TASKS)].format(n=s + 2)
    document = words(rng, args.document_words)  # what this session's task is about
    context = llm.tokenizer.encode(f"{SYSTEM}\nTask {s}: {task}\nDocument: {document}\n")
    cached = total = generated = 0
    times = []
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for turn in range(args.turns):
        start = time.perf_counter()
        key = f"session-{s}" if keyed else None
        stream = llm.generate(context, params, f"s{s}t{turn}", session_id=key)
        final = [output async for output in stream][-1]
        times.append(time.perf_counter() - start)
        answer = list(final.outputs[0].token_ids)
        generated += len(answer)
        if turn > 0:
            cached, total = cached + final.num_cached_tokens, total + len(context)
        result = words(rng, args.tool_words)
        tool = llm.tokenizer.encode(f"\nTool result {turn}: {result}\n", False)
        context = context + answer + tool
        await asyncio.sleep(args.tool_s * rng.uniform(0.2, 1.8))  # the tool runs
    return cached, total, times, generated


async def http_session(client: httpx.AsyncClient, tokenizer: Tokenizer,
                       args: argparse.Namespace, s: int, keyed: bool) -> tuple:  # fmt: skip
    """`run_session` over HTTP: each turn one /v1/completions request of the context's ids."""
    rng = random.Random(s)
    task = TASKS[s % len(TASKS)].format(n=s + 2)
    context = tokenizer.encode(f"{SYSTEM}\nTask {s}: {task}\n"
                               f"Document: {words(rng, args.document_words)}\n")  # fmt: skip
    cached = total = generated = 0
    times = []
    headers = {"X-Session-ID": f"session-{s}"} if keyed else {}
    for turn in range(args.turns):
        body = {"model": args.model, "prompt": context, "max_tokens": args.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        start = time.perf_counter()
        reply = (await client.post("/v1/completions", json=body, headers=headers)).json()
        times.append(time.perf_counter() - start)
        answer = reply["choices"][0]["token_ids"]
        generated += len(answer)
        if turn > 0:
            details = reply["usage"]["prompt_tokens_details"] or {}
            cached, total = cached + details.get("cached_tokens", 0), total + len(context)
        tool = tokenizer.encode(f"\nTool result {turn}: {words(rng, args.tool_words)}\n", False)
        context = context + answer + tool
        await asyncio.sleep(args.tool_s * rng.uniform(0.2, 1.8))  # the tool runs
    return cached, total, times, generated


def router_counters(text: str) -> tuple[int, list[int]]:
    """(session moves, requests per upstream) from the router's /metrics."""
    moves, routed = 0, []
    for line in text.splitlines():
        if line.startswith("hotswap_router:session_moves "):
            moves = int(float(line.split()[-1]))
        elif line.startswith("hotswap_router:routed{"):
            routed.append(int(float(line.split()[-1])))
    return moves, routed


async def run_servers_policy(args: argparse.Namespace, policy: str, urls: list[str]) -> Result:
    from tests.helpers.server import RemoteRouter

    async with httpx.AsyncClient(timeout=600) as plain:
        await asyncio.gather(*(plain.post(f"{u}/reset_prefix_cache") for u in urls))
    router = RemoteRouter(" ".join(urls), "--dp-routing", policy)
    tokenizer = Tokenizer.from_pretrained(args.model)
    try:
        async with router.async_client(timeout=600) as client:
            start = time.perf_counter()
            sessions = await asyncio.gather(*(
                http_session(client, tokenizer, args, s, policy == "session")
                for s in range(args.sessions)))  # fmt: skip
            wall = time.perf_counter() - start
            moves, routed = router_counters((await client.get("/metrics")).text)
    finally:
        router.stop()
    return summarise(f"{policy} (servers)", sessions, wall, moves, routed)


def summarise(policy: str, sessions: list[tuple], wall: float, moves: int,
              routed: list[int]) -> Result:  # fmt: skip
    cached = sum(s[0] for s in sessions)
    total = sum(s[1] for s in sessions)
    times = [t for s in sessions for t in s[2]]
    return Result(policy, cached / max(total, 1), 1000 * statistics.mean(times),
                  sum(s[3] for s in sessions) / wall, moves, routed)  # fmt: skip


def run_on_servers(args: argparse.Namespace) -> list[Result]:
    """Every policy against the same `--servers` processes, one router each."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers
    from tests.helpers.server import concurrent_servers

    spec = (args.model, "--dtype", args.dtype, "--num-threads", "1",
            "--enable-prompt-tokens-details")  # fmt: skip
    with concurrent_servers(*[spec] * args.servers) as servers:
        urls = [server.url for server in servers]
        return [asyncio.run(run_servers_policy(args, policy, urls)) for policy in args.policies]


async def warm_up(llm: AsyncLLM, i: int) -> None:
    async for _ in llm.generate("hi", SamplingParams(max_tokens=2), f"warm-up-{i}"):
        pass


async def run_policy(args: argparse.Namespace, policy: str) -> Result:
    llm = AsyncLLM(args.model, multiprocess=True, data_parallel_size=args.data_parallel_size,
                   dp_routing=policy, dtype=args.dtype, progress=False)  # fmt: skip
    try:
        await asyncio.gather(*(warm_up(llm, i) for i in range(args.data_parallel_size)))
        await llm.reset_prefix_cache()
        start = time.perf_counter()
        keyed = policy == "session"
        sessions = await asyncio.gather(
            *(run_session(llm, args, s, keyed) for s in range(args.sessions))
        )
        wall = time.perf_counter() - start
        stats = llm.front_end_stats()
    finally:
        llm.shutdown()
    return summarise(
        policy, sessions, wall, stats.get("dp_session_moves", 0), stats.get("dp_routed", [])
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in default model")
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tool-s", type=float, default=0.05, help="mean tool time between turns")
    p.add_argument("--document-words", type=int, default=150, help="each session's own text")
    p.add_argument("--tool-words", type=int, default=30, help="words in each tool result")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policies", nargs="+", default=["least-loaded", "session", "cache-aware"])
    p.add_argument("--servers", type=int, default=0,
                   help="also over HTTP: this many servers behind `hotswap route`")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    args.model = args.model or str(default_model_dir())
    results = [asyncio.run(run_policy(args, policy)) for policy in args.policies]
    if args.servers:
        results += run_on_servers(args)
    print(f"{args.sessions} sessions x {args.turns} turns, {args.data_parallel_size} ranks "
          f"(servers: {args.servers}), {args.max_tokens} tokens a turn")  # fmt: skip
    print(f"{'policy':<24}{'hit %':>7}{'turn ms':>9}{'tok/s':>8}{'moves':>7}  routed")
    for r in results:
        print(f"{r.policy:<24}{100 * r.hit_rate:>7.1f}{r.turn_ms:>9.0f}{r.tokens_per_s:>8.1f}"
              f"{r.moves:>7}  {r.routed}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
