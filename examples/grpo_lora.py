"""Async GRPO training a LoRA adapter: the recipe of examples/grpo_async.py (same task,
reward, PPO-clip step and one-step-off schedule), but the policy is the built-in model
plus a peft LoRA adapter, only the adapter is trained, and only the adapter is pushed.

The engine serves the base model with `--enable-lora`. The first push creates the
adapter "policy" on the engine (its lora_config travels with the round); every later
push sends its tensors (a few MB instead of the model's ~540 MB) as the adapter's next
version, through the same weight transfer backend (ipc here) and the same all-or-nothing
commit. Generation never pauses: an adapter's round is received beside the served
versions, and requests running at the commit finish on the version they started with.
Every token carries the adapter version that produced it (`WeightVersionSpan.
lora_version`), which is what the staleness mask reads.

    .venv/bin/python examples/grpo_lora.py --steps 20
    .venv/bin/python examples/grpo_lora.py --steps 20 --plot grpo_lora.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from _grpo_engines import Completion, InProcessEngine, Loop
from grpo_async import (
    GRPO,
    THRESHOLD,
    LoopThread,
    Trainer,
    children_on,
    pin_process,
    split_cores,
    summarize,
)
from grpo_async import parse_args as recipe_args

from hotswap.default_model import default_model_dir
from hotswap.lora.request import LoRARequest
from hotswap.rl import adapter_source, push_adapter
from hotswap.sampling_params import SamplingParams
from hotswap.weight_transfer import IPCTrainerInitInfo, WeightTransferTrainerFactory

ADAPTER = "policy"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--rank", type=int, default=16, help="the adapter's LoRA rank")
    extra.add_argument("--plot", default=None, help="save a reward-vs-step plot here")
    own, rest = extra.parse_known_args()
    args = recipe_args(["--lr", "2e-3", "--temperature", "0.7", *rest])
    args.rank, args.lora_plot = own.rank, own.plot
    return args


class AdapterTrainer(Trainer):
    """The recipe's trainer on a peft model: the base frozen, the adapter trained. peft
    wraps the model's linear layers in place, so the recipe's forward (`policy.model` and
    `policy.lm_head` of the underlying transformers model) runs through them."""

    def __init__(self, args: argparse.Namespace) -> None:
        import peft
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        self.args = args
        base = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
        config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                 target_modules=TARGETS)  # fmt: skip
        self.peft = peft.get_peft_model(base, config).train()  # B = 0: starts as the base
        self.policy = self.peft.get_base_model()
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)


class AdapterEngine(InProcessEngine):
    """Rollouts on the adapter (by name: the trainer's pushes create and update it), each
    token versioned by the adapter version that produced it."""

    def __init__(self, args: argparse.Namespace, loop: Loop) -> None:
        from hotswap import AsyncLLM

        self.llm = AsyncLLM(multiprocess=True, progress=False, dtype=args.dtype,
                            num_threads=args.engine_threads, seed=args.seed,
                            logprobs_mode="processed_logprobs", enable_lora=True,
                            max_lora_rank=args.rank,
                            weight_transfer_config={"backend": "ipc"})  # fmt: skip
        loop.run(self.llm.get_weight_info())  # starts the front-end on the loop thread
        from hotswap.weight_transfer import InProcessWeightSyncClient

        self.weight_client = InProcessWeightSyncClient(self.llm)
        self.ids = iter(range(1 << 62))

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        request_id = f"r{next(self.ids)}"
        adapter = LoRARequest(ADAPTER, 1)
        async for partial in self.llm.generate(prompt_ids, params, request_id, adapter):
            out = partial
        return [
            Completion(
                list(c.token_ids),
                [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
                [v for s in c.weight_versions for v in [s.lora_version] * (s.end - s.start)],
                c.text,
            )
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]


class AdapterGRPO(GRPO):
    def push(self, label: str) -> int:
        """Send the adapter (no pause: its round is received beside the rollouts); the
        adapter version committed."""
        start = time.perf_counter()
        committed = push_adapter(self.sync, self.trainer.peft, ADAPTER, label)
        self.push_bytes = sum(t.numel() * t.element_size() for _, t in self.sync.source.tensors)
        self.push_s = time.perf_counter() - start
        return committed.lora_version


def run(args: argparse.Namespace) -> dict[str, Any]:
    trainer_cores, engine_cores = split_cores(args.trainer_threads, args.engine_threads)
    pin_process(trainer_cores)
    torch.set_num_threads(args.trainer_threads)
    torch.manual_seed(args.seed)
    loop = LoopThread()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        with children_on(engine_cores, trainer_cores):
            engine = AdapterEngine(args, loop)
        stack.callback(engine.close)
        trainer = AdapterTrainer(args)
        sync = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(), engine.weight_client, adapter_source(trainer.peft)
        )
        stack.callback(sync.shutdown)
        grpo = AdapterGRPO(args, engine, loop, trainer, sync)
        print(f"adapter: rank {args.rank}, {grpo.push_bytes / 2**20:.1f} MiB per push "
              f"({grpo.push_s * 1000:.0f} ms for the first)")  # fmt: skip
        records = grpo.run()
    summary = {**summarize(args, records), "rank": args.rank,
               "push_mib": grpo.push_bytes / 2**20}  # fmt: skip
    print("summary: " + json.dumps(summary))
    if args.log_json:
        steps = [{"step": r.step, "reward": r.reward, "elapsed_s": r.elapsed_s} for r in records]
        Path(args.log_json).write_text(json.dumps({"summary": summary, "steps": steps}))
    if args.lora_plot:
        plot(records, args.lora_plot)
    return summary


def plot(records: list, path: str) -> None:  # noqa: ANN001
    import matplotlib  # examples-only dependency (the `test` extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r.step for r in records], [r.reward for r in records], "o-")
    ax.set_xlabel("optimizer step (adapter version)")
    ax.set_ylabel(f"mean reward (integer >= {THRESHOLD})")
    ax.set_title("GRPO training a LoRA adapter, rollouts from hotswap")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    run(parse_args())
