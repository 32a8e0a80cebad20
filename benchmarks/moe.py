"""Mixture-of-experts throughput: a Qwen3-MoE-shaped model with random weights, hotswap
against transformers and vLLM's CPU build, and what returning routed experts costs.

The model (written once per shape, bf16 safetensors and the built-in model's tokenizer):
hidden 1024, 8 layers, 16 query / 4 KV heads of 64, experts of intermediate size 512;
`--experts 16 --top-k 2` by default (`--experts 64 --top-k 8 --expert-size 128` keeps
the active parameters). Workloads, greedy with EOS ignored (every engine produces exactly
the tokens asked for):

- decode: 8 requests, 16 prompt / 64 output tokens;
- mixed: 64 requests, 128 prompt / 64 output tokens.

hotswap runs with and without `--enable-return-routed-experts` (alternating, best of
`--repeats`); transformers runs `generate` on the same batches (left-padded); vLLM in its
own venv (`--with-vllm`); `--parallel` adds two ranks, splitting every expert
(`tensor_parallel_size=2`) and holding half of them whole each (`enable_expert_parallel`).
`--expert-lora` adds one engine with LoRA on, every request on a peft adapter of rank 16 on
the routed experts (and q/v) against every request on the base model. `--fp8` adds an
engine with `--quantization fp8` (128 x 128 blocks: the routed experts, attention and
shared layers in FP8; router, embeddings and LM head in bf16), alternating with the others.
Then the experts' products alone: hotswap's fused call (one C++ call per layer), the same
products launched per expert from Python, and one padded
batched matmul over every expert.

    python benchmarks/moe.py [--experts 16] [--top-k 2] [--repeats 2] [--with-vllm]
                             [--parallel] [--expert-lora] [--fp8]
                             [--out benchmarks/results/moe-....json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import torch

WORKLOADS = {"decode": (8, 16, 64), "mixed": (64, 128, 64)}  # requests, prompt, output
LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=4096)  # vLLM's offline CPU limits
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_model(root: Path, experts: int, top_k: int, expert_size: int) -> Path:
    """A random Qwen3-MoE checkpoint (transformers writes it: per-expert tensor names)."""
    import transformers

    from hotswap.config import resolve_model_path

    out = root / f"qwen3-moe-e{experts}-k{top_k}-i{expert_size}"
    if (out / "model.safetensors").exists():
        return out
    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, intermediate_size=2048, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=expert_size, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source := resolve_model_path(None) / name).exists():
            shutil.copy(source, out / name)
    return out


def prompts(workload: str) -> tuple[list[list[int]], int]:
    requests, prompt_len, output_len = WORKLOADS[workload]
    rng = random.Random(0)
    return [[rng.randrange(100, 49152) for _ in range(prompt_len)] for _ in range(requests)], (
        output_len
    )


def timed_engine(llm, workload: str, vllm: bool = False, lora=None) -> float:  # noqa: ANN001
    ids, max_tokens = prompts(workload)
    if vllm:
        from vllm import SamplingParams
    else:
        from hotswap import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    extra = {} if lora is None else {"lora_request": lora}
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False, **extra)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(ids) * max_tokens
    return len(ids) * max_tokens / elapsed


def best_of(engines: dict, repeats: int, vllm: bool = False) -> dict[str, float]:
    """Best tok/s per (engine, workload), engines alternating."""
    for llm in engines.values():
        timed_engine(llm, "decode", vllm)  # warm-up
    best: dict[str, float] = {}
    for _ in range(repeats):
        for workload in WORKLOADS:
            for name, llm in engines.items():
                key = f"{name}, {workload}"
                best[key] = max(best.get(key, 0.0), timed_engine(llm, workload, vllm))
    return best


def transformers_tok_s(model_dir: Path, workload: str) -> float:
    """transformers' generate on the whole batch (left-padded; the padding's tokens are
    not counted)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids, max_tokens = prompts(workload)
    batch = torch.tensor(ids)
    with torch.inference_mode():
        model.generate(batch[:2, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=0)  # fmt: skip
        elapsed = time.perf_counter() - start
    assert out.shape[1] - batch.shape[1] == max_tokens
    return len(ids) * max_tokens / elapsed


def vllm_worker(model_dir: str, repeats: int) -> None:
    """In vLLM's venv: the same workloads; prints RESULT json."""
    from vllm import LLM

    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=2048, seed=0, **LIMITS)
    print("RESULT " + json.dumps(best_of({"vLLM": llm}, repeats, vllm=True)))


def run_vllm(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    python = Path(args.vllm_venv) / "bin" / "python"
    cmd = [str(python), __file__, "--vllm-worker", str(model_dir), "--repeats",
           str(args.repeats)]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        error = [line for line in done.stderr.splitlines() if "Error" in line][-3:]
        print("vLLM's CPU build did not run this model:\n" + "\n".join(error))
        return {}
    return json.loads(lines[-1].removeprefix("RESULT "))


def padded_bmm(experts, x, ids, weights):  # noqa: ANN001, ANN201
    """The alternative to hotswap's grouping: every expert's rows padded to the busiest
    expert's count, both products as one batched matmul each over all the experts."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.gate_up_proj.shape[0])
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(flat.numel()) - starts[flat[order]]
    padded = x.new_zeros(counts.numel(), width, x.shape[1])
    padded[flat[order], slot] = x[order // top_k]
    gate, up = torch.bmm(padded, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    down = torch.bmm(torch.nn.functional.silu(gate) * up, experts.down_proj.transpose(1, 2))
    out = torch.empty(flat.numel(), x.shape[1], dtype=x.dtype)
    out[order] = down[flat[order], slot]
    return (out.view(tokens, top_k, -1).float() * weights[..., None]).sum(1).to(x.dtype)


def expert_products(args: argparse.Namespace) -> list[tuple[int, float, float, float]]:
    """(rows, fused ms, grouped ms, padded bmm ms) for one layer's experts, bf16, best of
    20: the engine's single fused call (csrc/moe.cpp), the same products launched per
    expert from Python (the path before it, and batch-invariant mode's), and one padded
    batched matmul over every expert."""
    import dataclasses

    from hotswap.model.kernels import CpuKernels
    from hotswap.model.moe import FusedExperts, route

    kernels = CpuKernels.load(progress=False)
    experts = FusedExperts(args.experts, 1024, args.expert_size, torch.bfloat16, False)
    experts.kernels = dataclasses.replace(kernels, fused_moe=None)  # the Python grouping
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    fused = functools.partial(kernels.fused_moe, gate_up=experts.gate_up_proj,
                              down=experts.down_proj)  # fmt: skip
    results = []
    for rows in (1, 8, 64, 1024):
        x = torch.randn(rows, 1024, dtype=torch.bfloat16)
        weights, ids = route(torch.randn(rows, args.experts), args.top_k, True)
        times = []
        for fn in (lambda x, ids, weights: fused(x, ids=ids, weights=weights),
                   experts.forward, lambda *a: padded_bmm(experts, *a)):  # fmt: skip
            best = float("inf")
            with torch.inference_mode():
                for _ in range(20):
                    start = time.perf_counter()
                    fn(x, ids, weights)
                    best = min(best, time.perf_counter() - start)
            times.append(best * 1e3)
        results.append((rows, *times))
    return results


def parallel_tok_s(model_dir: Path, common: dict, repeats: int) -> dict[str, float]:
    """Two ranks splitting every expert (tensor parallelism) against two ranks holding
    half of the experts each (expert parallelism), alternating. On a 2-core host each
    rank gets one core: this measures the layouts' overheads, not a speed-up."""
    from hotswap import LLM

    engines = {"hotswap, tp=2": LLM(str(model_dir), tensor_parallel_size=2, **common),
               "hotswap, tp=2 + ep": LLM(str(model_dir), tensor_parallel_size=2,
                                         enable_expert_parallel=True, **common)}  # fmt: skip
    try:
        return best_of(engines, repeats)
    finally:
        for llm in engines.values():
            llm.shutdown()


def write_expert_adapter(model_dir: Path, rank: int = 16) -> Path:
    """A random peft adapter on the routed experts (`target_parameters`, stacked
    gate_up_proj and down_proj) and on q_proj / v_proj, as TRL trains MoE policies."""
    import peft
    import transformers

    out = model_dir.with_name(model_dir.name + f"-expert-lora-r{rank}")
    if (out / "adapter_model.safetensors").exists():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"],
                             init_lora_weights=False)  # fmt: skip
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def expert_lora_tok_s(model_dir: Path, common: dict, repeats: int) -> dict[str, float]:
    """One engine with LoRA on: every request on the expert adapter against every
    request on the base model, alternating."""
    from hotswap import LLM, LoRARequest

    adapter = LoRARequest("experts", 1, str(write_expert_adapter(model_dir)))
    llm = LLM(str(model_dir), enable_lora=True, max_lora_rank=16, **common)
    best: dict[str, float] = {}
    timed_engine(llm, "decode", lora=adapter)  # warm-up (loads the adapter)
    for _ in range(repeats):
        for workload in WORKLOADS:
            for name, lora in (("LoRA on, base rows", None), ("expert LoRA r=16", adapter)):
                key = f"hotswap, {name}, {workload}"
                best[key] = max(best.get(key, 0.0), timed_engine(llm, workload, lora=lora))
    return best


def cpu_name() -> str:
    """This machine's CPU as Linux names it (the results depend on its vector units)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--with-vllm", action="store_true", help="also vLLM's CPU build")
    parser.add_argument("--vllm-venv", default=str(Path(__file__).parent.parent / ".venv-vllm"))
    parser.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--parallel", action="store_true",
                        help="also two ranks: tensor against expert parallelism")  # fmt: skip
    parser.add_argument("--expert-lora", action="store_true",
                        help="also an adapter on the routed experts against the base")  # fmt: skip
    parser.add_argument("--fp8", action="store_true",
                        help="also an engine with FP8 weights (--quantization fp8)")  # fmt: skip
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(args.vllm_worker, args.repeats)
        return
    from hotswap import LLM
    from hotswap.default_model import cache_root

    model_dir = write_model(cache_root() / "bench-models", args.experts, args.top_k,
                            args.expert_size)  # fmt: skip
    common = dict(dtype="bfloat16", progress=False, **LIMITS)
    engines = {"hotswap": LLM(str(model_dir), **common),
               "hotswap, routed experts returned": LLM(
                   str(model_dir), enable_return_routed_experts=True, **common)}  # fmt: skip
    if args.fp8:
        engines["hotswap, fp8 weights"] = LLM(str(model_dir), quantization="fp8", **common)
    best = best_of(engines, args.repeats)
    del engines
    if args.parallel:
        best.update(parallel_tok_s(model_dir, common, args.repeats))
    if args.expert_lora:
        best.update(expert_lora_tok_s(model_dir, common, args.repeats))
    for workload in WORKLOADS:
        best[f"transformers, {workload}"] = transformers_tok_s(model_dir, workload)
    if args.with_vllm:
        best.update(run_vllm(args, model_dir))
    print(f"\nQwen3-MoE shape, {args.experts} experts, top-{args.top_k}, expert size "
          f"{args.expert_size}, bf16, best of {args.repeats}")  # fmt: skip
    print("| engine, workload | tok/s | vs hotswap |\n|---|---|---|")
    for name, value in best.items():
        reference = best["hotswap, " + name.rsplit(", ", 1)[1]]
        print(f"| {name} | {value:.1f} | {value / reference:.2f}x |")
    products = expert_products(args)
    print("\n| rows (one layer's experts) | fused call ms | per expert from Python ms "
          "| padded bmm ms |\n|---|---|---|---|")  # fmt: skip
    for rows, fused, grouped, padded in products:
        print(f"| {rows} | {fused:.2f} | {grouped:.2f} | {padded:.2f} |")
    if args.out:
        shape = dict(experts=args.experts, top_k=args.top_k, expert_size=args.expert_size)
        record = dict(shape=shape, tok_s=best, expert_products_ms=products,
                      cpu=cpu_name(), date=time.strftime("%Y-%m-%d"))  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
