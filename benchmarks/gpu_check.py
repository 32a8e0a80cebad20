"""Every check issue 38 asks of a lent GPU, in one run that fits its minutes (8 by default).

    bash benchmarks/gpu_check.sh [OUT_DIR]        (OUT_DIR: default $OUT)
    python3 benchmarks/gpu_check.py OUT_DIR [--budget 480] [--only STAGE ...]

Stages, most important first, each a subprocess given the smaller of its own limit and
the time left (a stage cut short is recorded as timed out, and the next one runs):

1. env: the GPU, torch, Triton.
2. kernels: tests/model/cuda/test_kernels.py and test_fp8_kernels.py on CUDA tensors
   (every Triton kernel against its torch reference; the FP8 KV cache in both formats and
   the blockwise FP8 GEMM).
3. throughput: benchmarks/throughput.py --device cuda on a Qwen3-0.6B-shaped bf16 model
   (benchmarks/bench_model.py) at 1, 64 and 256 requests: hotswap (CUDA graphs) against
   hotswap eager and transformers (transformers up to 64 requests).
4. engine: tests/model/cuda/test_cuda_engine.py (graphs = eager = CPU tokens, a sleep,
   one host read per graphed step, a mid-flight swap with graphs on equal to a fresh
   engine) and tests/execution/test_device.py.
5. profile: benchmarks/gpu_profile.py (GPU busy time over wall time, launches and host
   syncs per step, graphs and eager).
6. in_flight: benchmarks/in_flight.py --device cuda --backend ipc (generation during an
   open weight round against before it; target >= 0.95).
7. transfer: tests/weight_transfer/test_cuda.py (CUDA IPC handles).

Writes OUT_DIR/gpu_check.json after every stage (each stage's exit code, seconds, summary
and the tail of its output), plus throughput.json and profile.json: three files, within
what a device run brings back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MODEL_DIR = Path("/tmp/hotswap-bench/qwen3-0.6b")
ENGINE_ARGS = json.dumps({"kv_cache_memory_bytes": 32 << 30, "max_num_seqs": 256,
                          "max_num_batched_tokens": 8192})  # fmt: skip


def stages(out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, limit in seconds), in the order they run."""
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    model = str(MODEL_DIR)
    return [
        ("env", [PY, "-c", _ENV], 30),
        ("kernels", pytest + ["tests/model/cuda/test_kernels.py",
                              "tests/model/cuda/test_fp8_kernels.py"], 120),
        ("throughput", ["bash", "-c",
                        f"{PY} benchmarks/bench_model.py {model} && {PY} benchmarks/throughput.py "
                        f"--device cuda --model {model} --num-requests 64 256 --peers "
                        f"transformers eager --peer-max-requests 64 --repeats 1 "
                        f"--engine-args '{ENGINE_ARGS}' --json {out / 'throughput.json'}"], 210),
        ("engine", pytest + ["tests/model/cuda/test_cuda_engine.py",
                             "tests/execution/test_device.py"], 150),
        ("profile", [PY, "benchmarks/gpu_profile.py", "--model", model, "--json",
                     str(out / "profile.json")], 90),
        ("in_flight", [PY, "benchmarks/in_flight.py", "--device", "cuda", "--backend", "ipc",
                       "--model", model, "--streams", "64", "--rounds", "3", "--configs",
                       "paused", "keep", "swap", "--max-tokens", "3000", "--lead", "1",
                       "--tail", "0.5"], 120),
        ("transfer", pytest + ["tests/weight_transfer/test_cuda.py"], 60),
    ]  # fmt: skip


_ENV = (
    "import json, torch, triton; p = torch.cuda.get_device_properties(0); "
    "print(json.dumps({'gpu': p.name, 'sms': p.multi_processor_count, "
    "'memory_gib': p.total_memory / 2**30, 'torch': torch.__version__, "
    "'cuda': torch.version.cuda, 'triton': triton.__version__}))"
)


def summary(name: str, output: str) -> str:
    """The line that says how a stage went: pytest's tally, or the env's JSON."""
    tallies = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", output, re.M)
    if tallies:
        return tallies[-1]
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def run_stage(name: str, command: list[str], limit: float) -> dict:
    start = time.perf_counter()
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"
    )
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=limit)  # fmt: skip
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        output = _text(e.stdout) + _text(e.stderr)
    seconds = round(time.perf_counter() - start, 1)
    return {"stage": name, "rc": rc, "seconds": seconds, "summary": summary(name, output),
            "tail": output[-6000:]}  # fmt: skip


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=480, help="seconds for every stage")
    parser.add_argument("--only", nargs="+", default=None, help="these stages only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": []}
    for name, command, limit in stages(args.out):
        if args.only and name not in args.only:
            continue
        left = deadline - time.perf_counter()
        if left < 5:
            report["stages"].append({"stage": name, "rc": "skipped", "summary": "no time left"})
            continue
        result = run_stage(name, command, min(limit, left))
        report["stages"].append(result)
        print(f"{name}: rc {result['rc']} in {result['seconds']} s: {result['summary']}",
              flush=True)  # fmt: skip
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
