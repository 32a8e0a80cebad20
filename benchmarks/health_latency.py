"""`/health` latency while hostile requests are refused (issue 12): a poller measures
/health on a kept-alive connection while (a) a 50 MB body is refused 413 by its size, and
(b) with the body limit raised, a 50 MB text prompt is refused 400 (too long for the
model: checked before tokenizing, and tokenizing runs off the event loop anyway). Prints
p50/p99 of /health during each (target p99 <= 50 ms) and how long each refusal took.

    python benchmarks/health_latency.py [--model DIR] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx
from serve import percentile, start_server

PROMPT_BYTES = 50 << 20


def refuse_while_polling(url: str, body: bytes) -> tuple[int, float, list[float]]:
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get("/health").raise_for_status()
                latencies.append(time.perf_counter() - start)
                time.sleep(0.002)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)  # the poller's baseline
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", content=body, timeout=300,
                          headers={"content-type": "application/json"})  # fmt: skip
    elapsed = time.perf_counter() - start
    time.sleep(0.5)
    stop.set()
    poller.join()
    return response.status_code, elapsed, latencies


def main(args: argparse.Namespace) -> None:
    body = b'{"model": "bench", "prompt": "' + b"a " * (PROMPT_BYTES // 2) + b'", "max_tokens": 1}'
    cases = {
        "50 MB body, default limit (413)": [],
        "50 MB prompt, limit raised (400)": ["--max-request-body-bytes", str(100 << 20)],
    }
    for name, extra in cases.items():
        proc, url = start_server(args, None, extra)
        try:
            status, elapsed, latencies = refuse_while_polling(url, body)
        finally:
            proc.terminate()
            proc.wait(30)
        p50, p99 = statistics.median(latencies) * 1e3, percentile(latencies, 0.99) * 1e3
        print(f"{name:<34} answered {status} after {elapsed * 1e3:7.0f} ms; /health "
              f"p50 {p50:5.1f} ms  p99 {p99:5.1f} ms over {len(latencies)} calls "
              f"(target p99 <= 50 ms)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
