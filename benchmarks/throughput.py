"""Offline throughput: hotswap vs Hugging Face transformers `generate` on the same weights.

Each measurement runs in its own subprocess (so peak memory is per engine), with a warm-up
first; the engines alternate and each keeps its best of `--repeats` runs. Workloads use
greedy decoding with EOS ignored, so both sides produce exactly the requested number of
tokens. transformers runs the requests as one left-padded batch (its
batched `generate`), which decodes until the longest request is done; only the requested
tokens are counted as output.

    python benchmarks/throughput.py [--model DIR] [--dtype bfloat16|float32]
        [--num-requests 64 [256 ...]] [--device cuda] [--peers transformers eager]
        [--engine-args JSON] [--json FILE]

Peers: `transformers`; `eager`, hotswap itself with `enforce_eager` (no CUDA graphs, no
compiled decode steps); with `--baseline DIR`, hotswap from another checkout (a
regression check: `git worktree add /tmp/base COMMIT`, then `--baseline /tmp/base`).
`--engine-args` passes hotswap's engine arguments (a GPU run wants a larger
`kv_cache_memory_bytes` and `max_num_seqs` than the CPU defaults); `--json` writes every
row.
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


def run_hotswap(
    model: str | None, dtype: str, requests: list[dict], device: str, engine_args: dict
) -> float:
    from hotswap import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, progress=False, device=device, **engine_args)
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
    if args.worker in ("hotswap", "eager"):
        engine_args = json.loads(args.engine_args or "{}")
        if args.worker == "eager":
            engine_args["enforce_eager"] = True
        elapsed = run_hotswap(args.model, args.dtype, requests, args.device, engine_args)
    else:
        elapsed = run_transformers(args.model_dir, args.dtype, requests, args.device)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"elapsed": elapsed, "peak_mib": peak_mib}
    if args.device.startswith("cuda"):
        import torch

        result["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result))


def measure(engine: str, args: argparse.Namespace, model_dir: str, requests: list[dict]) -> dict:
    """One run in a fresh process. `baseline` is the hotswap worker of another checkout
    (its own benchmarks/throughput.py, its package first on the path)."""
    script, env = __file__, None
    if engine == "baseline":
        script = str(Path(args.baseline) / "benchmarks" / "throughput.py")
        env = dict(os.environ, PYTHONPATH=str(Path(args.baseline).resolve()))
        engine = "hotswap"
    cmd = [sys.executable, script, "--worker", engine, "--dtype", args.dtype,
           "--model-dir", model_dir, "--device", args.device]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    if args.engine_args and engine != "transformers":
        cmd += ["--engine-args", args.engine_args]
    proc = subprocess.run(
        cmd, input=json.dumps(requests), capture_output=True, text=True, check=False, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["tokens_per_s"] = sum(r["max_tokens"] for r in requests) / result["elapsed"]
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: built-in model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both engines)")
    parser.add_argument(
        "--num-requests",
        type=int,
        nargs="+",
        default=[64],
        help="mixed workloads, one per count (besides the 1-request one)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per engine (best kept)")
    parser.add_argument(
        "--peers", nargs="+", choices=["transformers", "eager"], default=["transformers"]
    )
    parser.add_argument(
        "--peer-max-requests",
        type=int,
        default=None,
        help="run the transformers peer only up to this many requests",
    )
    parser.add_argument(
        "--engine-args",
        default=None,
        metavar="JSON",
        help="hotswap engine arguments, e.g. '{\"max_num_seqs\": 256}'",
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the rows here")
    parser.add_argument(
        "--worker", choices=["hotswap", "eager", "transformers"], help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="compare with hotswap from this checkout (e.g. a `git worktree` of an earlier "
        "commit) instead of transformers",
    )
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from hotswap.config import read_hf_config, resolve_model_path

    model_dir = str(resolve_model_path(args.model))
    vocab = int(read_hf_config(resolve_model_path(args.model))["vocab_size"])
    scenarios = [("1 request (128 in, 128 out)", make_workload(1, vocab, args.seed, mixed=False))]
    scenarios += [(f"{n} mixed requests", make_workload(n, vocab, args.seed, mixed=True))
                  for n in args.num_requests]  # fmt: skip
    peers = ["baseline"] if args.baseline else args.peers
    print(f"model: {model_dir}\ndtype: {args.dtype}\ndevice: {args.device}\n")
    print(f"{'workload':30} {'engine':>12} {'tok/s':>10} {'hotswap x':>10} {'peak MiB':>9}")
    rows = []
    for name, requests in scenarios:
        engines = ["hotswap"] + [p for p in peers if p != "transformers" or args.peer_max_requests
                                 is None or len(requests) <= args.peer_max_requests]  # fmt: skip
        # Alternate the engines and keep each one's best run: this machine's timings vary
        # by ~5% run to run, and interleaving keeps slow phases from favouring one side.
        runs: dict[str, list[dict]] = {engine: [] for engine in engines}
        for _ in range(args.repeats):
            for engine in runs:
                runs[engine].append(measure(engine, args, model_dir, requests))
        best = {e: max(r, key=lambda x: x["tokens_per_s"]) for e, r in runs.items()}
        for engine, result in best.items():
            ratio = best["hotswap"]["tokens_per_s"] / result["tokens_per_s"]
            rows.append({"workload": name, "engine": engine, "requests": len(requests), **result,
                         "hotswap_ratio": ratio})  # fmt: skip
            print(f"{name:30} {engine:>12} {result['tokens_per_s']:10.1f} {ratio:9.2f}x "
                  f"{result['peak_mib']:9.0f}", flush=True)  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
