"""Pause and resume latency under a saturated engine, next to the engine's own step time.

64 streaming requests keep the engine busy (finished or aborted streams are replaced at
once). For each pause mode we time `pause_generation` from call to return, then
`resume_generation`, over several cycles, and print p50/p99 with the median decode step
measured by the engine core in the same run. The engine core runs in its own process, as
under `hotswap serve`. (vLLM's AsyncLLM.pause_generation sleeps a fixed 20 ms on top.)

    python benchmarks/pause_resume.py [--model DIR] [--streams 64] [--cycles 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from hotswap import AsyncLLM, RequestOutputKind, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Saturator:
    """Keeps `count` streams running; replaces each one as soon as it ends."""

    def __init__(
        self, llm: AsyncLLM, count: int, max_tokens: int, vocab: int, kind: RequestOutputKind
    ) -> None:
        self.llm, self.max_tokens, self.vocab, self.kind = llm, max_tokens, vocab, kind
        self.rng = random.Random(0)
        self.ids = 0
        self.tasks = [asyncio.ensure_future(self._run_forever()) for _ in range(count)]

    async def _run_forever(self) -> None:
        while True:
            self.ids += 1
            prompt = [self.rng.randrange(100, self.vocab) for _ in range(64)]
            # Staggered lengths: replacements arrive one by one, not as one prefill burst.
            budget = self.rng.randint(self.max_tokens // 2, self.max_tokens * 2)
            params = SamplingParams(
                temperature=0.0, max_tokens=budget, ignore_eos=True, output_kind=self.kind
            )
            async for _ in self.llm.generate({"prompt_token_ids": prompt}, params, f"s{self.ids}"):
                pass

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


async def measure(args: argparse.Namespace) -> None:
    llm = AsyncLLM(
        args.model,
        multiprocess=not args.inproc,
        progress=False,
        max_prefill_tokens_while_decoding=args.prefill_cap or None,
    )
    kind = RequestOutputKind[args.output_kind.upper()]
    saturator = Saturator(llm, args.streams, args.max_tokens, llm.config.model.vocab_size, kind)
    await asyncio.sleep(args.warmup)
    results: dict[str, list[float]] = {"resume": []}
    plan = [("keep", args.cycles), ("abort", args.cycles), ("wait", args.wait_cycles)]
    stats = {}
    for mode, cycles in plan:
        results[mode] = []
        for _ in range(cycles):
            await asyncio.sleep(0.2 + random.random() * 0.1)  # let the batch refill
            start = time.perf_counter()
            await llm.pause_generation(mode=mode, clear_cache=False)
            results[mode].append(time.perf_counter() - start)
            start = time.perf_counter()
            await llm.resume_generation()
            results["resume"].append(time.perf_counter() - start)
        if mode == "keep":  # the steps a keep pause waited for: this phase's (last 256)
            stats = await llm.get_stats()
    saturator.stop()
    llm.shutdown()
    report(results, stats, args)


def report(results: dict[str, list[float]], stats: dict, args: argparse.Namespace) -> None:
    step, step_p99 = stats["step_ms_p50"], stats["step_ms_p99"]
    print(
        f"model: {args.model or 'built-in SmolLM2-135M-Instruct'}, {args.streams} streams, "
        f"engine core in {'this process' if args.inproc else 'a child process'}, "
        f"prefill cap while decoding: {args.prefill_cap or 'none'}, "
        f"{args.output_kind} outputs"
    )
    print(
        f"engine step during the keep cycles (the steps a keep pause waits out): "
        f"p50 {step:.1f} ms, p99 {step_p99:.1f} ms\n"
    )
    print(f"{'call':14} {'n':>4} {'p50 ms':>9} {'p99 ms':>9}   target")
    targets = {
        "keep": f"p99 <= step p99 + 5 ms = {step_p99 + 5:.1f} ms",
        "resume": "p99 <= 5 ms",
        "abort": "(aborts every stream)",
        "wait": "(drains every stream)",
    }
    for name in ("keep", "abort", "wait", "resume"):
        values = [1000 * v for v in results[name]]
        label = "resume" if name == "resume" else f"pause({name})"
        print(
            f"{label:14} {len(values):4d} {statistics.median(values):9.1f} "
            f"{percentile(values, 0.99):9.1f}   {targets[name]}"
        )
    print(
        "\nvLLM adds a fixed 20 ms sleep to every pause, so its pause(keep) is at least "
        f"step in flight + 20 ms: p50 >= {step / 2 + 20:.1f} ms here."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--wait-cycles", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--inproc", action="store_true", help="engine core on a thread")
    parser.add_argument(
        "--output-kind",
        default="delta",
        choices=["cumulative", "delta", "final_only"],
        help="how the 64 streams receive outputs (front-end load)",
    )
    parser.add_argument(
        "--prefill-cap",
        type=int,
        default=0,
        help="max_prefill_tokens_while_decoding (0: no cap, the default)",
    )
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
