"""How far hotswap's sampled-token logprobs are from an fp32 trainer's, per engine precision.

An RL trainer computes its importance ratio exp(logp_trainer - logp_engine) on the tokens
the engine sampled. With no policy change that ratio should be 1; any gap is precision
noise the trainer mistakes for off-policyness. This script samples rollouts (temperature
1, processed logprobs) from the default model with each engine setting, scores the same
tokens with transformers in float32 (the trainer), and prints |delta logp| on them.

    python benchmarks/logprob_precision.py [--prompts 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hotswap import LLM, SamplingParams
from hotswap.default_model import default_model_dir

SETTINGS = {
    "bf16": {"dtype": "bfloat16"},
    "bf16 + fp32 LM head": {"dtype": "bfloat16", "lm_head_dtype": "float32"},
    "fp32": {"dtype": "float32"},
}
PROMPTS = [
    "Give me a number larger than fifty:",
    "The capital of France is",
    "Write a haiku about gradient descent.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Q: What is 17 + 25?\nA:",
    "List three colours:",
    "Reinforcement learning is",
]


def trainer_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) + len(tokens) - 1]
    return torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(tokens)[:, None]).flatten()


def measure(name: str, engine_args: dict, prompts: list[str], max_tokens: int, trainer) -> dict:  # noqa: ANN001
    llm = LLM(None, progress=False, logprobs_mode="processed_logprobs", **engine_args)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=0)
    deltas: list[float] = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        comp = out.outputs[0]
        ours = torch.tensor([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
        theirs = trainer_logprobs(trainer, out.prompt_token_ids, comp.token_ids)
        deltas.extend((ours - theirs).abs().tolist())
    del llm
    ratio = [float(torch.tensor(d).exp()) for d in deltas]
    return {
        "setting": name,
        "tokens": len(deltas),
        "mean": statistics.fmean(deltas),
        "p99": sorted(deltas)[int(0.99 * (len(deltas) - 1))],
        "max": max(deltas),
        "max_ratio": max(ratio),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = default_model_dir(progress=False)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = PROMPTS[: args.prompts]
    print("| engine | tokens | mean abs dlogp | p99 | max | max ratio exp(dlogp) |")
    print("|---|---|---|---|---|---|")
    for name, engine_args in SETTINGS.items():
        r = measure(name, engine_args, prompts, args.max_tokens, trainer)
        print(
            f"| {r['setting']} | {r['tokens']} | {r['mean']:.2e} | {r['p99']:.2e} | "
            f"{r['max']:.2e} | {r['max_ratio']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
