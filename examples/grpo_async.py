"""Async GRPO on the built-in model: a transformers policy learns a verifiable task from
hotswap rollouts, and its weights are pushed into the running engine after every
optimizer step.

The task: asked for a number from 1 to 100, answer with an integer >= 50 (reward 1 if the
first integer in the completion is >= 50, else 0; about 0.3 at the start). Each step
samples `--group-size` completions for each of `--prompts-per-step` prompts, normalises
rewards within each group (GRPO advantages) and takes one PPO-clip step on importance
ratios against the logprobs the engine reports. The engine runs with
`logprobs_mode="processed_logprobs"`: the log-probability of each sampled token under the
distribution the sampler actually drew from (after temperature), which is what the
trainer recomputes (log_softmax(logits / T)). Every token also carries the committed
weight version that produced it (`CompletionOutput.token_versions`); tokens more than
`--max-staleness` versions behind the trainer are masked out of the loss.

After each optimizer step: pause the engine in place (`keep`: requests in flight are
frozen, not lost), push the weights (`--transport ipc`, the default: the trainer's
parameters live in shared memory, so the engine copies each weight once; or `gloo`), and
resume. `send_weights()` returns the committed version, which is what token versions are
compared with. `--in-flight` pushes without a pause: the engine keeps generating on the
old weights while the new ones arrive and switches between two steps (requests in flight
recompute their KV then), so rollouts never idle during a push; the price is that tokens
sampled during the push carry the old version, one more version of staleness for them.

    --mode sync    generate batch k, train on it, push; repeat
    --mode async   one-step-off: batch k+1 is generated while batch k trains (the push
                   after step k lands mid-flight: the rest of batch k+1 is sampled from
                   the new weights, and its token versions say which tokens are which)

The trainer (this process) and the engine are pinned to disjoint CPU cores
(`--trainer-threads`, `--engine-threads`), as real deployments split trainer and rollout
hardware, so on a 2-core machine the overlap of `async` is measurable. `--compare` runs
both modes one after the other and saves a reward-vs-time plot (matplotlib).

Rollouts come from hotswap in process (the default: `AsyncLLM` with its engine core in a
child process), over HTTP from `hotswap serve`, or from engine actors on a local Ray
(`--engine ray`, `--ray-engines N`; weights over ipc, gloo, or Ray's object store with
`--transport ray`):

    .venv/bin/python examples/grpo_async.py --mode async --steps 30
    .venv/bin/python examples/grpo_async.py --compare --steps 20 --plot grpo.png
    .venv/bin/python examples/grpo_async.py --engine http          # starts hotswap serve
    .venv/bin/python examples/grpo_async.py --engine ray --transport ray
    # or against a server you started (same machine for ipc; pin it to its own core):
    taskset -c 1 .venv/bin/hotswap serve --enable-control --dtype float32 --num-threads 1 \\
        --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "ipc"}'
    .venv/bin/python examples/grpo_async.py --engine http --server-url http://127.0.0.1:8000

`--dtype float32` (the default) makes engine and trainer agree to ~1e-6 nats on on-policy
tokens; `--dtype bfloat16 --lm-head-dtype float32` is faster on a GPU and costs
precision (see the README). On a CPU the trainer's backward pass dominates, so by default
only the top `--train-layers` decoder layers (and the final norm) are trained; -1 trains
every weight. Every weight is pushed either way.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _grpo_engines import (
    Completion,
    HTTPEngine,
    InProcessEngine,
    RayEngine,
    RolloutEngine,
    hotswap_server,
)

from hotswap.default_model import default_model_dir
from hotswap.sampling_params import SamplingParams
from hotswap.tokenizer import Tokenizer
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    IPCTrainerInitInfo,
    ModuleSource,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

# -- the task ---------------------------------------------------------------------------
QUESTIONS = [
    "Pick a number between 1 and 100.",
    "Give me a random integer from 1 to 100.",
    "Think of a number from 1 to 100.",
    "Choose an integer between 1 and 100.",
    "Name a whole number from 1 to 100.",
    "Tell me a number between 1 and 100.",
]
THRESHOLD = 50


def prompt_text(question: str) -> str:
    # A plain Q/A frame: the instruct model answers with a number straight away, which
    # keeps completions (and so each step) short.
    return f"Question: {question}\nAnswer:"


def reward(text: str) -> float:
    """1 if the first integer in the completion is >= THRESHOLD, else 0."""
    match = re.search(r"-?\d+", text)
    return float(match is not None and int(match.group()) >= THRESHOLD)


# -- configuration ----------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["sync", "async"], default="async")
    p.add_argument("--compare", action="store_true", help="run sync, then async; plot both")
    p.add_argument("--plot", default="grpo_async_compare.png", help="--compare's PNG")
    p.add_argument("--engine", choices=["inprocess", "http", "ray"], default="inprocess")
    p.add_argument("--ray-engines", type=int, default=1, help="ray: engine actors")
    p.add_argument("--server-url", default=None, help="http: a running hotswap serve")
    p.add_argument("--transport", choices=["ipc", "gloo", "ray"], default="ipc",
                   help="ray: through Ray's object store (--engine ray only)")  # fmt: skip
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=900.0, help="start no step after this")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--max-staleness", type=int, default=1, help="in weight versions")
    p.add_argument("--in-flight", action="store_true",
                   help="push without pausing: rollouts keep generating while the weights "
                   "arrive, and requests in flight recompute their KV at the switch")  # fmt: skip
    p.add_argument("--train-layers", type=int, default=4, help="top decoder layers; -1 all")
    p.add_argument("--dtype", default="float32", help="engine dtype")
    p.add_argument("--lm-head-dtype", default=None, help="engine LM head dtype")
    p.add_argument("--trainer-threads", type=int, default=1)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", default=None, help="write per-step records + summary")
    return p.parse_args(argv)


# -- CPU placement ----------------------------------------------------------------------
def split_cores(trainer_threads: int, engine_threads: int) -> tuple[set[int], set[int]]:
    """Disjoint core sets for trainer and engine, from the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    if trainer_threads + engine_threads > len(cores):
        raise SystemExit(f"--trainer-threads + --engine-threads > {len(cores)} usable cores")
    return set(cores[:trainer_threads]), set(cores[trainer_threads:][:engine_threads])


def pin_process(cores: set[int], pid: int = 0) -> None:
    """Every thread of `pid` (0: this process) onto `cores`; threads started later
    inherit it, and so do child processes."""
    pid = pid or os.getpid()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread may just have ended
            os.sched_setaffinity(int(task), cores)


@contextlib.contextmanager
def children_on(cores: set[int], home: set[int]) -> Iterator[None]:
    """Processes started inside run on `cores` (they inherit this process's affinity)."""
    pin_process(cores)
    try:
        yield
    finally:
        pin_process(home)


class LoopThread:
    """An asyncio loop on a thread: the rollouts run there while the trainer computes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# -- rollouts ---------------------------------------------------------------------------
@dataclass
class Sample:
    prompt_ids: list[int]
    completion: Completion
    reward: float
    advantage: float = 0.0


async def rollout_batch(
    engine: RolloutEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[Sample], float]:
    """Every group of the step at once (the engine batches them); (samples, seconds)."""
    start = time.perf_counter()
    groups = await asyncio.gather(*(engine.complete(p, sp) for p, sp in zip(prompts, params)))
    samples = []
    for prompt_ids, group in zip(prompts, groups):
        batch = [Sample(prompt_ids, c, reward(c.text)) for c in group]
        rewards = torch.tensor([s.reward for s in batch])
        # GRPO: the group is the baseline; a group that agrees teaches nothing (0).
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for sample, advantage in zip(batch, advantages.tolist()):
            sample.advantage = advantage
        samples += batch
    return samples, time.perf_counter() - start


# -- the trainer ------------------------------------------------------------------------
def load_policy(train_layers: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    policy = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    if train_layers >= 0:
        policy.requires_grad_(False)
        for layer in policy.model.layers[len(policy.model.layers) - train_layers :]:
            layer.requires_grad_(True)
        policy.model.norm.requires_grad_(True)
    return policy.train()


@dataclass
class TrainStats:
    loss: float = 0.0
    trained_tokens: int = 0
    stale_tokens: int = 0  # masked out: older than --max-staleness
    on_policy_tokens: int = 0
    abs_dlogp_sum: float = 0.0  # |trainer - engine| logprob over on-policy tokens
    abs_dlogp_max: float = 0.0
    clip_fraction: float = 0.0


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.policy = load_policy(args.train_layers)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)

    def step(self, samples: list[Sample], version: int) -> TrainStats:
        """One PPO-clip step on the samples that carry signal; `version` is the engine
        version holding the trainer's current weights."""
        useful = [s for s in samples if s.advantage != 0.0 and s.completion.token_ids]
        if not useful:
            return TrainStats()
        batch = self._tensors(useful, version)
        new_logp = self._logprobs(batch["input_ids"], batch["positions"], batch["targets"])
        stats = self._stats(new_logp.detach(), batch)
        ratio = torch.exp(new_logp - batch["old_logp"])
        eps, adv = self.args.clip_eps, batch["advantages"][:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        mask = batch["train_mask"]
        loss = -(surrogate * mask).sum() / mask.sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        if mask.any():
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()
        stats.loss = loss.item()
        clipped = ((ratio.detach() - 1).abs() > eps) & mask
        stats.clip_fraction = clipped.sum().item() / max(mask.sum().item(), 1)
        return stats

    def _tensors(self, samples: list[Sample], version: int) -> dict[str, torch.Tensor]:
        """Right-padded prompt + completion ids, and per completion token: where its
        logit is, the token, the engine's logprob, and which tokens count."""
        length = max(len(s.prompt_ids) + len(s.completion.token_ids) for s in samples)
        width = max(len(s.completion.token_ids) for s in samples)
        input_ids = torch.zeros(len(samples), length, dtype=torch.long)
        positions = torch.zeros(len(samples), width, dtype=torch.long)
        targets = torch.zeros(len(samples), width, dtype=torch.long)
        old_logp = torch.zeros(len(samples), width)
        versions = torch.full((len(samples), width), -1, dtype=torch.long)
        valid = torch.zeros(len(samples), width, dtype=torch.bool)
        for row, s in enumerate(samples):
            ids, n, start = s.completion.token_ids, len(s.completion.token_ids), len(s.prompt_ids)
            input_ids[row, : start + n] = torch.tensor(s.prompt_ids + ids)
            positions[row, :n] = torch.arange(start - 1, start + n - 1)  # logit predicting it
            targets[row, :n] = torch.tensor(ids)
            old_logp[row, :n] = torch.tensor(s.completion.logprobs)
            versions[row, :n] = torch.tensor(s.completion.versions)
            valid[row, :n] = True
        fresh = valid & (version - versions <= self.args.max_staleness)
        return {
            "input_ids": input_ids, "positions": positions, "targets": targets,
            "old_logp": old_logp, "valid": valid, "train_mask": fresh,
            "on_policy": valid & (versions == version),
            "advantages": torch.tensor([s.advantage for s in samples]),
        }  # fmt: skip

    def _logprobs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """log_softmax(logits / T) of each completion token, computed like the engine's
        processed logprobs (top_p = 1, top_k = 0: temperature is the only processing).
        Right padding never reaches a real token under the causal mask, and the LM head
        runs on completion positions only."""
        hidden = self.policy.model(input_ids=input_ids).last_hidden_state
        index = positions[..., None].expand(-1, -1, hidden.shape[-1])
        logits = self.policy.lm_head(hidden.gather(1, index)).float() / self.args.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]

    def _stats(self, new_logp: torch.Tensor, batch: dict[str, torch.Tensor]) -> TrainStats:
        on_policy = batch["on_policy"]
        delta = (new_logp - batch["old_logp"]).abs()[on_policy]
        return TrainStats(
            trained_tokens=int(batch["train_mask"].sum()),
            stale_tokens=int((batch["valid"] & ~batch["train_mask"]).sum()),
            on_policy_tokens=int(on_policy.sum()),
            abs_dlogp_sum=float(delta.sum()),
            abs_dlogp_max=float(delta.max()) if delta.numel() else 0.0,
        )


# -- the loop ---------------------------------------------------------------------------
@dataclass
class StepRecord:
    step: int
    reward: float
    elapsed_s: float  # since the first rollout was submitted
    step_s: float
    generate_s: float  # the batch's own rollout time (in async, overlapping training)
    wait_s: float  # how long the trainer waited for the batch
    train_s: float
    push_s: float  # pause + send_weights + resume
    version: int  # the engine's version after this step's push
    stats: TrainStats = field(default_factory=TrainStats)


class GRPO:
    def __init__(self, args: argparse.Namespace, engine: RolloutEngine, loop: LoopThread,
                 trainer: Trainer, sync: TrainerWeightTransferEngine) -> None:  # fmt: skip
        self.args, self.engine, self.loop = args, engine, loop
        self.trainer, self.sync = trainer, sync
        self.tokenizer = Tokenizer.from_pretrained(default_model_dir())
        self.rng = random.Random(args.seed)
        self.version = self.push("initial")  # the engine starts from the trainer's weights

    def push(self, label: str) -> int:
        """Pause in place, send every weight, resume; the committed version. With
        --in-flight there is no pause: rollouts keep generating on the old weights while
        the new ones arrive (tokens sampled meanwhile carry the old version, so they count
        one version staler), and the switch lands between two engine steps."""
        if self.args.in_flight:
            return self.sync.send_weights(label).version
        self.loop.run(self.engine.pause())
        try:
            committed = self.sync.send_weights(label)
        finally:
            self.loop.run(self.engine.resume())
        return committed.version

    def submit(self, step: int) -> concurrent.futures.Future:
        """Start step `step`'s rollouts on the loop thread."""
        questions = self.rng.sample(QUESTIONS, self.args.prompts_per_step)
        prompts = [self.tokenizer.encode(prompt_text(q), add_special_tokens=False)
                   for q in questions]  # fmt: skip
        params = [
            SamplingParams(
                n=self.args.group_size, temperature=self.args.temperature, top_p=1.0,
                top_k=0, max_tokens=self.args.max_tokens, logprobs=0,
                seed=self.args.seed * 1_000_003 + step * 1009 + i,
            )
            for i in range(len(prompts))
        ]  # fmt: skip
        return self.loop.submit(rollout_batch(self.engine, prompts, params))

    def run(self) -> list[StepRecord]:
        records: list[StepRecord] = []
        start = time.perf_counter()
        pending = self.submit(0)
        for step in range(self.args.steps):
            if time.perf_counter() - start > self.args.max_seconds:
                print(f"--max-seconds reached after {step} steps")
                break
            step_start = time.perf_counter()
            samples, generate_s = pending.result()
            wait_s = time.perf_counter() - step_start
            last = step + 1 == self.args.steps
            if self.args.mode == "async" and not last:
                pending = self.submit(step + 1)  # generated while this batch trains
            train_start = time.perf_counter()
            stats = self.trainer.step(samples, self.version)
            push_start = time.perf_counter()
            self.version = self.push(f"step-{step + 1}")
            push_s = time.perf_counter() - push_start
            if self.args.mode == "sync" and not last:
                pending = self.submit(step + 1)
            now = time.perf_counter()
            records.append(StepRecord(
                step, sum(s.reward for s in samples) / len(samples), now - start,
                now - step_start, generate_s, wait_s, push_start - train_start, push_s,
                self.version, stats,
            ))  # fmt: skip
            print_step(records[-1])
        if not pending.done():
            pending.cancel()  # leaving the rollouts aborts their requests
        return records


def print_step(r: StepRecord) -> None:
    s = r.stats
    dlogp = f"{s.abs_dlogp_sum / s.on_policy_tokens:.2e}" if s.on_policy_tokens else "n/a"
    print(f"step {r.step:3d} | reward {r.reward:.3f} | step {r.step_s:5.2f}s "
          f"(generate {r.generate_s:5.2f}, wait {r.wait_s:5.2f}, train {r.train_s:5.2f}, "
          f"push {r.push_s:4.2f}) | |dlogp| on-policy {dlogp} over {s.on_policy_tokens} "
          f"| clip {s.clip_fraction:.3f} | stale masked {s.stale_tokens} | v{r.version}",
          flush=True)  # fmt: skip


def summarize(args: argparse.Namespace, records: list[StepRecord]) -> dict[str, Any]:
    rewards = [r.reward for r in records]
    k = max(1, min(3, len(rewards) // 3))
    on_policy = sum(r.stats.on_policy_tokens for r in records)
    steady = records[1:] or records  # step 0 also waits for the first batch
    return {
        "mode": args.mode, "engine": args.engine, "transport": args.transport,
        "dtype": args.dtype, "steps": len(records),
        "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
        "mean_step_s": sum(r.step_s for r in steady) / len(steady),
        "mean_generate_s": sum(r.generate_s for r in steady) / len(steady),
        "mean_train_s": sum(r.train_s for r in steady) / len(steady),
        "mean_push_s": sum(r.push_s for r in steady) / len(steady),
        "on_policy_tokens": on_policy,
        "mean_abs_dlogp": sum(r.stats.abs_dlogp_sum for r in records) / on_policy
        if on_policy else None,
        "max_abs_dlogp": max((r.stats.abs_dlogp_max for r in records), default=None),
        "total_s": records[-1].elapsed_s if records else 0.0,
    }  # fmt: skip


def trainer_init(
    args: argparse.Namespace, engine: RolloutEngine, trainer: Trainer
) -> TrainerWeightTransferEngine:
    if args.transport == "ipc":
        # share_source: the parameters move into shared memory once, in place (the
        # optimizer keeps working); each push then sends only names and offsets.
        info: Any = IPCTrainerInitInfo(share_source=True)
    elif args.transport == "ray":
        from hotswap.ray import RayTrainerInitInfo

        info = RayTrainerInitInfo()
    else:
        from _rlhf_http import free_port

        workers = getattr(engine.weight_client, "num_workers", 1)  # a group: all its engines
        info = GlooTrainerInitInfo(master_port=free_port(), world_size=1 + workers)
    return WeightTransferTrainerFactory.trainer_init(
        info, engine.weight_client, ModuleSource(trainer.policy)
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    trainer_cores, engine_cores = split_cores(args.trainer_threads, args.engine_threads)
    pin_process(trainer_cores)
    torch.set_num_threads(args.trainer_threads)
    torch.manual_seed(args.seed)
    print(f"mode {args.mode}: trainer on cores {sorted(trainer_cores)}, engine on "
          f"{sorted(engine_cores)} ({args.engine}, {args.dtype}, {args.transport})")  # fmt: skip
    loop = LoopThread()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        with children_on(engine_cores, trainer_cores):
            engine = open_engine(args, loop, stack)
        trainer = Trainer(args)
        sync = trainer_init(args, engine, trainer)
        stack.callback(sync.shutdown)
        records = GRPO(args, engine, loop, trainer, sync).run()
    summary = summarize(args, records)
    print("summary: " + json.dumps(summary))
    if args.log_json:
        Path(args.log_json).write_text(json.dumps(
            {"summary": summary, "steps": [asdict(r) for r in records]}, indent=1
        ))  # fmt: skip
    return summary


def open_engine(
    args: argparse.Namespace, loop: LoopThread, stack: contextlib.ExitStack
) -> RolloutEngine:
    if args.engine == "inprocess":
        engine: RolloutEngine = InProcessEngine(args, loop)
    elif args.engine == "ray":
        engine = RayEngine(args)
    else:
        url = args.server_url or stack.enter_context(hotswap_server(args))
        engine = HTTPEngine(url, loop)
    stack.callback(engine.close)
    return engine


# -- --compare --------------------------------------------------------------------------
def compare(args: argparse.Namespace) -> None:
    """Both modes, each in a fresh process (fresh policy and engine), then the plot."""
    forwarded = [a for a in sys.argv[1:] if a != "--compare"]
    logs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            log = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, *forwarded, "--mode", mode, "--log-json", str(log)]
            subprocess.run(cmd, check=True)
            logs[mode] = json.loads(log.read_text())
    sync_s, async_s = (logs[m]["summary"]["mean_step_s"] for m in ("sync", "async"))
    print(f"compare: mean step {sync_s:.2f} s sync, {async_s:.2f} s async: "
          f"async is {sync_s / async_s:.2f}x faster per step")  # fmt: skip
    plot(logs, args.plot)
    print(f"compare: reward-vs-time plot saved to {args.plot}")


def plot(logs: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib  # examples-only dependency (the `test` extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, log in logs.items():
        steps = log["steps"]
        s = log["summary"]
        label = f"{mode} ({s['mean_step_s']:.1f} s/step)"
        ax.plot([r["elapsed_s"] for r in steps], [r["reward"] for r in steps], "o-", label=label)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"mean reward (integer >= {THRESHOLD})")
    ax.set_title("GRPO on SmolLM2-135M-Instruct, rollouts from hotswap")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    if args.compare:
        compare(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
