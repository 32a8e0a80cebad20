"""Control-call latency over HTTP: pause (keep), resume and /weight_info against this
tree's `hotswap serve` and, with `--baseline SRC`, a second server run from another
checkout (e.g. `git worktree add /tmp/base 208207c`), driven alternately in blocks so the
machine's noise falls on both. Prints p50/p99 per call and the ratio this / baseline
(issue 11's target: <= 1.05 at p50).

    python benchmarks/control_latency.py [--model DIR] [--calls 300] [--baseline SRC]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
from serve import percentile, start_server

CALLS = {
    "pause(keep)": ("POST", "/pause", {"mode": "keep", "clear_cache": "false"}),
    "resume": ("POST", "/resume", None),
    "weight_info": ("GET", "/weight_info", None),
}


def measure(http: httpx.Client, calls: int, samples: dict[str, list[float]]) -> None:
    for _ in range(calls):
        for name, (method, path, params) in CALLS.items():
            start = time.perf_counter()
            response = http.request(method, path, params=params)
            samples[name].append(time.perf_counter() - start)
            response.raise_for_status()


def main(args: argparse.Namespace) -> None:
    args.dtype = "float32"
    sources = {"this tree": None} | ({"baseline": args.baseline} if args.baseline else {})
    servers = {name: start_server(args, src, ["--enable-control"]) for name, src in sources.items()}
    samples = {name: {call: [] for call in CALLS} for name in servers}
    try:
        clients = {
            name: httpx.Client(base_url=url, timeout=30) for name, (_, url) in servers.items()
        }
        for http in clients.values():  # warm-up: connections, first-call paths
            measure(http, 10, {call: [] for call in CALLS})
        block = max(1, args.calls // 10)
        for _ in range(0, args.calls, block):
            for name, http in clients.items():
                measure(http, block, samples[name])
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    print(f"{args.calls} calls each, idle default model (float32), keep-alive connection")
    for call in CALLS:
        row = []
        for name in servers:
            values = samples[name][call]
            p50, p99 = statistics.median(values) * 1e3, percentile(values, 0.99) * 1e3
            row.append((name, p50, p99))
            print(f"{call:<12} {name:<10} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms")
        if len(row) == 2:
            print(f"{call:<12} ratio      p50 {row[0][1] / row[1][1]:.3f}  "
                  f"p99 {row[0][2] / row[1][2]:.3f}  (target <= 1.05)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--baseline", default=None, help="checkout to compare the server with")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
