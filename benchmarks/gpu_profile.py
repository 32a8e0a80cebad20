"""Where a GPU decode step's time goes: 20 engine steps of a 64-request mixed workload under
torch.profiler, once with CUDA graphs and once eager. Reports, per configuration, the GPU's
busy time (the union of its kernels' intervals) over the steps' wall time, kernel launches
per step (graph replays count their kernels), host syncs per step, and the kernels that
took the most time.

    python benchmarks/gpu_profile.py --model DIR [--json FILE] [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import make_workload  # noqa: E402

FIRST_STEP, STEPS = 12, 20  # profiled: steps 12..31 (every prefill done by then)


def busy_fraction(kernels: list[tuple[float, float]], wall: float) -> float:
    """The union of [start, end) intervals (microseconds) over `wall` microseconds."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(kernels):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / wall if wall else 0.0


def profile(model: str, requests: list[dict], engine_args: dict, device: str) -> dict:
    from torch.profiler import ProfilerActivity

    from hotswap import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", device=device, progress=False, **engine_args)
    engine, steps, window = llm.engine, [0], {}
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=activities)
    original = engine.step
    synchronize = torch.cuda.synchronize if cuda else lambda: None

    def step():  # noqa: ANN202
        if steps[0] == FIRST_STEP:
            synchronize()
            prof.start()
            window["start"] = time.perf_counter()
        result = original()
        steps[0] += 1
        if steps[0] == FIRST_STEP + STEPS:
            synchronize()
            window["wall"] = time.perf_counter() - window["start"]
            prof.stop()
        return result

    engine.step = step
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in requests]  # fmt: skip
    llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    graphs = engine.runner.graphs
    llm.shutdown()
    return summarise(prof, window["wall"], graphs)


def summarise(prof, wall: float, graphs) -> dict:  # noqa: ANN001
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    syncs = [e for e in events if "Synchronize" in e.name or e.name == "aten::_local_scalar_dense"]
    sort = "cuda_time_total" if kernels else "cpu_time_total"
    top = prof.key_averages().table(sort_by=sort, row_limit=15)
    return {
        "wall_ms_per_step": 1e3 * wall / STEPS,
        "gpu_busy_fraction": busy_fraction(intervals, wall * 1e6),
        "kernels_per_step": len(kernels) / STEPS,
        "host_syncs_per_step": len(syncs) / STEPS,
        "graph_steps": graphs.graph_steps if graphs is not None else 0,
        "top_kernels": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--engine-args", default='{"kv_cache_memory_bytes": 17179869184}')
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: checks the script, no kernels")
    args = parser.parse_args()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    requests = make_workload(args.requests, vocab, 0, mixed=True)
    for r in requests:  # every request outlives the profiled steps
        r["max_tokens"] = max(r["max_tokens"], FIRST_STEP + STEPS + 8)
    engine_args = json.loads(args.engine_args)
    results = {}
    for name, extra in (("graphs", {}), ("eager", {"enforce_eager": True})):
        results[name] = profile(args.model, requests, {**engine_args, **extra}, args.device)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "top_kernels"}))
        print(results[name]["top_kernels"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
