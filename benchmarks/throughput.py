"""Offline throughput: hotswap vs Hugging Face transformers `generate` on the same weights.

Each measurement runs in its own subprocess (so peak memory is per engine), with a warm-up
first; the engines alternate and each keeps its best of `--repeats` runs. Workloads use
greedy decoding with EOS ignored, so both sides produce exactly the requested number of
tokens. transformers runs the requests as one left-padded batch (its
batched `generate`), which decodes until the longest request is done; only the requested
tokens are counted as output.

    python benchmarks/throughput.py [--model DIR] [--dtype bfloat16|float32] [--num-requests 64]
        [--device cuda]

With `--baseline DIR` the peer is hotswap from another checkout instead (a regression
check: `git worktree add /tmp/base COMMIT`, then `--baseline /tmp/base`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path


def make_workload(num_requests: int, vocab_size: int, seed: int, mixed: bool) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(16, 512) if mixed else 128
        output_len = rng.randint(16, 256) if mixed else 128
        prompt = [rng.randrange(100, vocab_size) for _ in range(prompt_len)]
        requests.append({"prompt": prompt, "max_tokens": output_len})
    return requests


def run_hotswap(model: str | None, dtype: str, requests: list[dict], device: str) -> float:
    from hotswap import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, progress=False, device=device)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([r["prompt"] for r in requests[:4]], warm, use_tqdm=False)
    llm.reset_prefix_cache()  # no prefix hits from the warm-up
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(r["max_tokens"] for r in requests)
    return elapsed


def run_transformers(model_dir: str, dtype: str, requests: list[dict], device: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval().to(device)
    model.generation_config.eos_token_id = None  # ignore EOS, like the hotswap side
    pad = 0

    def generate(batch: list[dict], max_new: int) -> None:
        width = max(len(r["prompt"]) for r in batch)
        ids = torch.tensor(
            [[pad] * (width - len(r["prompt"])) + r["prompt"] for r in batch], device=device
        )
        mask = torch.tensor(
            [[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in batch],
            device=device,
        )
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=pad
            )

    generate(requests[:4], 8)
    start = time.perf_counter()
    generate(requests, max(r["max_tokens"] for r in requests))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    requests = json.loads(sys.stdin.read())
    if args.worker == "hotswap":
        elapsed = run_hotswap(args.model, args.dtype, requests, args.device)
    else:
        elapsed = run_transformers(args.model_dir, args.dtype, requests, args.device)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"elapsed": elapsed, "peak_mib": peak_mib}))


def measure(engine: str, args: argparse.Namespace, model_dir: str, requests: list[dict]) -> dict:
    """One run in a fresh process. `baseline` is the hotswap worker of another checkout
    (its own benchmarks/throughput.py, its package first on the path)."""
    script, env = __file__, None
    if engine == "baseline":
        script = str(Path(args.baseline) / "benchmarks" / "throughput.py")
        env = dict(os.environ, PYTHONPATH=str(Path(args.baseline).resolve()))
        engine = "hotswap"
    cmd = [
        sys.executable,
        script,
        "--worker",
        engine,
        "--dtype",
        args.dtype,
        "--model-dir",
        model_dir,
        "--device",
        args.device,
    ]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.run(
        cmd, input=json.dumps(requests), capture_output=True, text=True, check=False, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["tokens_per_s"] = sum(r["max_tokens"] for r in requests) / result["elapsed"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: built-in model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both engines)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per engine (best kept)")
    parser.add_argument("--worker", choices=["hotswap", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="compare with hotswap from this checkout (e.g. a `git worktree` of an earlier "
        "commit) instead of transformers",
    )
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from hotswap.config import read_hf_config, resolve_model_path

    model_dir = str(resolve_model_path(args.model))
    vocab = int(read_hf_config(resolve_model_path(args.model))["vocab_size"])
    scenarios = [
        ("1 request (128 in, 128 out)", make_workload(1, vocab, args.seed, mixed=False)),
        (
            f"{args.num_requests} mixed requests",
            make_workload(args.num_requests, vocab, args.seed, mixed=True),
        ),
    ]
    print(f"model: {model_dir}\ndtype: {args.dtype}\ndevice: {args.device}\n")
    peer, peer_label = ("baseline", "base") if args.baseline else ("transformers", "HF")
    header = (
        f"{'workload':32} {'hotswap tok/s':>14} {peer_label + ' tok/s':>10} {'ratio':>7} "
        f"{'hotswap peak':>13} {peer_label + ' peak':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, requests in scenarios:
        # Alternate the engines and keep each one's best run: this machine's timings vary
        # by ~5% run to run, and interleaving keeps slow phases from favouring one side.
        runs: dict[str, list[dict]] = {"hotswap": [], peer: []}
        for _ in range(args.repeats):
            for engine in runs:
                runs[engine].append(measure(engine, args, model_dir, requests))
        ours = max(runs["hotswap"], key=lambda r: r["tokens_per_s"])
        theirs = max(runs[peer], key=lambda r: r["tokens_per_s"])
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        print(
            f"{name:32} {ours['tokens_per_s']:14.1f} {theirs['tokens_per_s']:10.1f} "
            f"{ratio:6.2f}x {ours['peak_mib']:10.0f} MiB {theirs['peak_mib']:5.0f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
