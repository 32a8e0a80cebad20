"""Generation throughput of `hotswap serve --data-parallel-size 2` with the engine cores as
child processes (`--data-parallel-backend mp`) vs as Ray actors (`ray`, the server starting
its own local Ray), on this machine.

Both servers run side by side and are driven alternately, the order flipping every round,
so both see the same machine noise (on a shared machine that noise is large: compare the
medians, and the CPU time, which it barely moves). The idle server costs little: the mp
one nothing, the Ray one its daemons' few percent of a core, which both sides then pay.
The workload is serve.py's: N concurrent streaming clients, fixed-length random token-id
prompts, greedy, EOS ignored. Prints tokens/s (best and median), the CPU seconds the
server's whole process tree (Ray's processes included) spent per 1000 tokens, and the ratio
ray / mp (target >= 0.9).

    python benchmarks/dp_backends.py [--model DIR] [--clients 32] [--max-tokens 64]
        [--rounds 6] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections import defaultdict
from pathlib import Path

from serve import make_prompts, run_http, start_server

from hotswap.config import read_hf_config, resolve_model_path

BACKENDS = ("mp", "ray")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of `pid` and every live process below it (Linux /proc)."""
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total = 0.0
    for proc, seconds in times.items():
        node = proc
        while node not in (pid, 0, 1) and node in parent:
            node = parent[node]
        total += seconds if node == pid else 0.0
    return total


async def main(args: argparse.Namespace) -> None:
    vocab = read_hf_config(resolve_model_path(args.model))["vocab_size"]
    servers = {}
    for backend in BACKENDS:
        extra = ["--data-parallel-size", str(args.data_parallel_size)]
        servers[backend] = start_server(args, extra=[*extra, "--data-parallel-backend", backend])
    rates: dict[str, list[float]] = defaultdict(list)
    cpu_per_k: dict[str, list[float]] = defaultdict(list)
    try:
        for _proc, url in servers.values():  # warm-up
            await run_http(url, "bench", make_prompts(4, args.prompt_len, vocab, 99), 8)
        for round_index in range(args.rounds):
            prompts = make_prompts(args.clients, args.prompt_len, vocab, round_index)
            order = BACKENDS if round_index % 2 == 0 else tuple(reversed(BACKENDS))
            for backend in order:
                proc, url = servers[backend]
                before = tree_cpu_seconds(proc.pid)
                result = await run_http(url, "bench", prompts, args.max_tokens)
                cpu = tree_cpu_seconds(proc.pid) - before
                rates[backend].append(result.tokens_per_s)
                cpu_per_k[backend].append(1000 * cpu / result.tokens)
                print(f"round {round_index} {backend:<4} {result.tokens_per_s:7.1f} tok/s "
                      f"{cpu_per_k[backend][-1]:6.2f} cpu-s/1k tokens", flush=True)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    print(f"{args.clients} streaming clients, {args.prompt_len}-token prompts, "
          f"{args.max_tokens} tokens each, {args.dtype}, data parallel "
          f"{args.data_parallel_size}, {args.rounds} rounds")  # fmt: skip
    for backend in BACKENDS:
        print(f"{backend:<4} best {max(rates[backend]):7.1f} tok/s  median "
              f"{statistics.median(rates[backend]):7.1f} tok/s  "
              f"{statistics.median(cpu_per_k[backend]):6.2f} cpu-s/1k tokens")  # fmt: skip
    best = max(rates["ray"]) / max(rates["mp"])
    median = statistics.median(rates["ray"]) / statistics.median(rates["mp"])
    cpu = statistics.median(cpu_per_k["mp"]) / statistics.median(cpu_per_k["ray"])
    print(f"ray / mp throughput ratio: best {best:.3f}, median {median:.3f}, "
          f"CPU efficiency {cpu:.3f} (target >= 0.9)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
