"""LoRA serving cost: a 64-request batch on the base model, and on 1 and 4 distinct
adapters, against an engine started without LoRA (the base), in one alternating run; then
what a trainer's push costs: the adapter's tensors against every weight of the model,
through the same backend (ipc, in process) into the same engine.

The adapters are random PEFT-format adapters (adapter_config.json + adapter_model.
safetensors, every linear layer targeted) written for the model at the given rank.
Requests are greedy with EOS ignored, so every run produces the same number of tokens.

    python benchmarks/lora.py [--model DIR] [--rank 16] [--num-requests 64] [--repeats 2]
                              [--tensor-parallel-size 1]

With `--tensor-parallel-size 2` both engines run on two ranks (a model whose heads split:
the default model's 9 do not; benchmarks/tp.py writes one), each rank holding its part of
every adapter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int) -> Path:
    """A random adapter in PEFT's layout for the Llama-family model in `model_dir`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (out_f, in_f) in shapes.items():
            block = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGETS), "bias": "none"}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def workload(num_requests: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(num_requests)]


def timed(llm, prompts, loras, max_tokens: int, vllm: bool = False) -> float:  # noqa: ANN001
    if vllm:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": p} for p in prompts]
    else:
        from hotswap import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * max_tokens
    return len(prompts) * max_tokens / elapsed


# vLLM's offline batch limits on a CPU (benchmarks/vs_vllm.py); both engines get them.
LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=4096)


def runs(engines: dict, requests: list, num_prompts: int, label: str) -> dict:  # noqa: ANN001
    """The four workloads: (engine, lora_request) by name."""
    base, lora = engines["base"], engines["lora"]
    return {
        f"{label}: base engine (no --enable-lora)": (base, None),
        f"{label}: --enable-lora, base rows": (lora, None),
        f"{label}: 1 adapter": (lora, requests[0]),
        f"{label}: 4 adapters": (lora, [requests[i % 4] for i in range(num_prompts)]),
    }


def measure(workloads: dict, prompts: list, max_tokens: int, repeats: int,
            vllm: bool = False) -> dict[str, float]:  # fmt: skip
    """Best tok/s of each workload, the workloads alternating."""
    for llm, loras in workloads.values():  # warm-up (adapters loaded, kernels warm)
        timed(llm, prompts[:4], loras if not isinstance(loras, list) else loras[:4], 4, vllm)
    best = {name: 0.0 for name in workloads}
    for _ in range(repeats):
        for name, (llm, loras) in workloads.items():
            best[name] = max(best[name], timed(llm, prompts, loras, max_tokens, vllm))
    return best


def vllm_worker(args: argparse.Namespace) -> None:
    """In vLLM's venv: the same workloads on vLLM's CPU build; prints RESULT json."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest as VLLMLoRARequest

    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0, **LIMITS)
    engines = {
        "base": LLM(**common),
        "lora": LLM(**common, enable_lora=True, max_loras=4, max_lora_rank=args.rank),
    }
    requests = [VLLMLoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(args.adapters)]
    prompts = workload(args.num_requests, 49152, 0)
    best = measure(runs(engines, requests, len(prompts), "vLLM"), prompts, args.max_tokens,
                   args.repeats, vllm=True)  # fmt: skip
    print("RESULT " + json.dumps(best))


def run_vllm(args: argparse.Namespace, model_dir: Path, adapters: list[Path]) -> dict:
    python = Path(args.vllm_venv) / "bin" / "python"
    cmd = [str(python), __file__, "--vllm-worker", "--model", str(model_dir), "--dtype",
           args.dtype, "--rank", str(args.rank), "--num-requests", str(args.num_requests),
           "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
           "--adapters", *map(str, adapters)]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"vLLM run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return {}
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: built-in)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--with-vllm", action="store_true", help="also vLLM's CPU build")
    parser.add_argument("--vllm-venv", default=str(Path(__file__).parent.parent / ".venv-vllm"))
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(args)
        return

    from hotswap import LLM, LoRARequest
    from hotswap.config import resolve_model_path

    model_dir = resolve_model_path(args.model)
    root = Path(tempfile.mkdtemp(prefix="hotswap-lora-bench-", dir=model_dir.parent))
    adapters = [write_adapter(model_dir, root / f"a{i}", args.rank, i) for i in range(4)]
    kwargs = dict(dtype=args.dtype, progress=False, tensor_parallel_size=args.tensor_parallel_size,
                  **LIMITS)  # fmt: skip
    engines = {"base": LLM(str(model_dir), **kwargs),
               "lora": LLM(str(model_dir), enable_lora=True, max_loras=4,
                           max_lora_rank=args.rank, **kwargs)}  # fmt: skip
    prompts = workload(args.num_requests, engines["base"].engine.vocab_size, 0)
    requests = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    best = measure(runs(engines, requests, len(prompts), "hotswap"), prompts, args.max_tokens,
                   args.repeats)  # fmt: skip
    for engine in engines.values():
        engine.shutdown()
    if args.with_vllm:
        best.update(run_vllm(args, model_dir, adapters))
    print(f"\n{args.num_requests} requests x (128 prompt + {args.max_tokens} output tokens), "
          f"rank {args.rank}, {args.dtype}, TP={args.tensor_parallel_size}, best of "
          f"{args.repeats}")  # fmt: skip
    print("| workload | tok/s | vs the same engine's base |\n|---|---|---|")
    for name, value in best.items():
        reference = best[name.split(":")[0] + ": base engine (no --enable-lora)"]
        print(f"| {name} | {value:.1f} | {value / reference:.2f}x |", flush=True)
    push = measure_push(model_dir, args.rank, args.dtype)
    print("\n| push (ipc, in process, best of 3) | MiB sent | ms |\n|---|---|---|")
    for name, (mib, ms) in push.items():
        print(f"| {name} | {mib:.1f} | {ms:.0f} |")


def measure_push(model_dir: Path, rank: int, dtype: str) -> dict[str, tuple[float, float]]:
    """A round of every weight (the trainer's transformers model) against a round of the
    adapter only (its peft model), into one engine: (MiB, best ms) each."""
    import peft
    from transformers import AutoModelForCausalLM

    from hotswap import LLM
    from hotswap.rl import adapter_source, push_adapter
    from hotswap.weight_transfer import (
        InProcessWeightSyncClient,
        IPCTrainerInitInfo,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    llm = LLM(str(model_dir), dtype=dtype, enable_lora=True, max_lora_rank=rank,
              weight_transfer_config={"backend": "ipc"}, progress=False)  # fmt: skip
    client = InProcessWeightSyncClient(llm)

    def trainer_model():  # noqa: ANN202
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS))
    policy = peft.get_peft_model(trainer_model(), config)
    full = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client,
                                                     ModuleSource(trainer_model()))  # fmt: skip
    adapter = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client,
                                                        adapter_source(policy))  # fmt: skip
    rounds = {
        "every weight (ModuleSource)": (full, lambda: full.send_weights("full")),
        f"adapter only, rank {rank} (push_adapter)": (
            adapter, lambda: push_adapter(adapter, policy, "policy")),
    }  # fmt: skip
    results = {}
    for name, (sender, send) in rounds.items():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            send()
            times.append((time.perf_counter() - start) * 1000)
        nbytes = sum(m.numel * m.dtype.itemsize for m in sender.source.metadata())
        results[name] = (nbytes / 2**20, min(times))
    return results


if __name__ == "__main__":
    main()
