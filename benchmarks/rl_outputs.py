"""What RL outputs cost: prompt logprobs, processed logprobs and penalties, and that plain
requests are not slowed by their existence (against an earlier commit of hotswap).

Every variant runs the same mixed workload (`throughput.py`'s: prompts 16-512, outputs
16-256 tokens, EOS ignored) through `LLM` in its own subprocess; variants alternate and
each keeps its best of `--repeats`. With `--baseline-ref REF`, the plain workload also runs
on that commit (checked out into a temporary git worktree), and the script prints this
tree's plain throughput over the baseline's.

    python benchmarks/rl_outputs.py [--num-requests 64] [--baseline-ref 208207c]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import make_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# variant -> (engine args, per-request sampling options)
VARIANTS: dict[str, tuple[dict, dict]] = {
    "plain (greedy)": ({}, {"temperature": 0.0}),
    "sampled, logprobs=1, raw": ({}, {"temperature": 1.0, "seed": 0, "logprobs": 1}),
    "sampled, logprobs=1, processed": (
        {"logprobs_mode": "processed_logprobs"},
        {"temperature": 1.0, "seed": 0, "logprobs": 1},
    ),
    "greedy + prompt_logprobs=1": ({}, {"temperature": 0.0, "prompt_logprobs": 1}),
    "greedy + penalties": (
        {},
        {"temperature": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.3},
    ),
}


def run_variant(engine_args: dict, options: dict, requests: list[dict], dtype: str) -> float:
    from hotswap import LLM, SamplingParams

    llm = LLM(None, progress=False, dtype=dtype, **engine_args)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([r["prompt"] for r in requests[:4]], warm, use_tqdm=False)
    llm.reset_prefix_cache()
    params = [
        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **options) for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(r["max_tokens"] for r in requests)
    return elapsed


def spawn(variant: str, args: argparse.Namespace, pythonpath: str | None = None) -> float:
    cmd = [sys.executable, __file__, "--worker", variant, "--dtype", args.dtype]
    cmd += ["--num-requests", str(args.num_requests)]
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])["elapsed"]


def baseline_tree(ref: str) -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="hotswap-baseline-")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", tmp.name, ref],
        check=True,
        capture_output=True,
    )
    return tmp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--baseline-ref", default=None, help="git ref to compare plain with")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    requests = make_workload(args.num_requests, 49152, seed=0, mixed=True)
    if args.worker:
        if args.worker == "baseline":
            engine_args, options = {}, {"temperature": 0.0}
        else:
            engine_args, options = VARIANTS[args.worker]
        elapsed = run_variant(engine_args, options, requests, args.dtype)
        print(json.dumps({"elapsed": elapsed}))
        return
    tokens = sum(r["max_tokens"] for r in requests)
    names = list(VARIANTS) + (["baseline"] if args.baseline_ref else [])
    best = dict.fromkeys(names, float("inf"))
    baseline = baseline_tree(args.baseline_ref) if args.baseline_ref else None
    try:
        for _ in range(args.repeats):
            for name in names:
                path = baseline.name if name == "baseline" and baseline else None
                best[name] = min(best[name], spawn(name, args, path))
    finally:
        if baseline is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", baseline.name])
    plain = tokens / best["plain (greedy)"]
    print(
        f"{args.num_requests} mixed requests, {tokens} output tokens, {args.dtype}, "
        f"best of {args.repeats}"
    )
    print("| variant | tok/s | vs plain greedy |\n|---|---|---|")
    for name in names:
        rate = tokens / best[name]
        label = f"{args.baseline_ref} (plain greedy)" if name == "baseline" else name
        print(f"| {label} | {rate:.1f} | {rate / plain:.3f} |")
    if args.baseline_ref:
        print(f"this tree / {args.baseline_ref} (plain): {plain / (tokens / best['baseline']):.3f}")


if __name__ == "__main__":
    main()
