"""Async GRPO on a vision-language model: a tiny random Qwen2.5-VL learns to read the
colour of a square in an image from hotswap rollouts, and its language model is pushed
into the running engine after every optimizer step.

The task: a 56x56 grey image with one square (red, green or blue; random size and place)
and the question "What colour is the square?"; reward 1 if the completion starts with the
square's colour word, else 0. The model is written at run time into a temporary directory
(tests/helpers/tiny_vl.py: random weights, a 384-token tokenizer, nothing downloaded), so
it first gets a short supervised warm-up on the answer format: every image with each of
the three words as its answer, so it learns to say a colour word but not which one (the
best fit to those labels ignores the image; the reward starts near 1/3). GRPO then does
the rest: each step samples `--group-size` completions for each of `--prompts-per-step`
images, normalises rewards within each group and takes one PPO-clip step on importance
ratios against the engine's `processed_logprobs` (the behaviour policy), masking tokens
more than `--max-staleness` weight versions behind the trainer (`token_versions`).

The trainer is transformers' `Qwen2_5_VLForConditionalGeneration` in float32, fed the
engine's expanded `prompt_token_ids` (one `<|image_pad|>` per merged patch) with the
image's `pixel_values` and `image_grid_thw` from `hotswap.multimodal.images.process_image`
(bit for bit what the engine's tower sees). The vision tower is frozen, as in most VL RL
recipes; every push (ipc, the trainer's parameters in shared memory) sends only the
language model and the LM head under transformers' names (`model.language_model.*`,
`lm_head.weight`): a partial round, which leaves the engine's tower as it is.

One-step-off, as examples/grpo_async.py (whose loop, placement and printing this reuses):
the batch of step k+1 is generated while step k trains; after each step the engine pauses
in place (`keep`), receives the round, and resumes.

    .venv/bin/python examples/grpo_vl.py                     # 150 steps, ~25 s
    .venv/bin/python examples/grpo_vl.py --steps 100 --seed 1 --log-json vl.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import random
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _grpo_engines import Completion, InProcessEngine, Loop, completions, engine_options
from grpo_async import (
    GRPO,
    LoopThread,
    Sample,
    Trainer,
    children_on,
    pin_process,
    split_cores,
    summarize,
)
from PIL import Image

from hotswap.multimodal.images import ImageProcessorConfig, ProcessedImage, process_image
from hotswap.sampling_params import SamplingParams
from hotswap.tokenizer import Tokenizer
from hotswap.weight_transfer import (
    IPCTrainerInitInfo,
    ModuleSource,
    ParamMeta,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

REPO = Path(__file__).resolve().parents[1]

# -- the task ---------------------------------------------------------------------------
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 40), "blue": (40, 60, 230)}
GREY = 128
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one per image, as Qwen2.5-VL's
PROMPT = f"<|im_start|>user\n{IMAGE}What colour is the square?<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Picture:
    image: Image.Image
    processed: ProcessedImage  # what the trainer's vision tower takes
    colour: str


class ColourTask:
    def __init__(self, model_dir: Path, size: int, seed: int) -> None:
        self.config = ImageProcessorConfig.from_model_dir(model_dir)
        self.size, self.rng = size, np.random.default_rng(seed)

    def draw(self) -> Picture:
        """A grey image with one square of a random colour, size and place."""
        colour = str(self.rng.choice(list(COLOURS)))
        side = int(self.rng.integers(self.size // 4, self.size // 2 + 1))
        x, y = self.rng.integers(0, self.size - side + 1, size=2)
        pixels = np.full((self.size, self.size, 3), GREY, dtype=np.uint8)
        pixels[y : y + side, x : x + side] = COLOURS[colour]
        image = Image.fromarray(pixels)
        return Picture(image, process_image(image, self.config), colour)


def reward(text: str, colour: str) -> float:
    return float(text.strip().startswith(colour))


# -- configuration ----------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["sync", "async"], default="async")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--max-seconds", type=float, default=600.0, help="start no step after this")
    p.add_argument("--prompts-per-step", type=int, default=16, help="images per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--max-staleness", type=int, default=1, help="in weight versions")
    p.add_argument("--warmup-steps", type=int, default=60, help="format-only supervised steps")
    p.add_argument("--warmup-lr", type=float, default=1e-2)
    p.add_argument("--image-size", type=int, default=56, help="pixels a side")
    p.add_argument("--model-dir", default=None, help="reuse (or write) the tiny model here")
    p.add_argument("--trainer-threads", type=int, default=1)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", default=None, help="write per-step records + summary")
    args = p.parse_args(argv)
    # what the recipe's shared pieces read: an in-process float32 engine, ipc pushes
    args.engine, args.transport, args.in_flight = "inprocess", "ipc", False
    args.dtype, args.lm_head_dtype = "float32", None
    return args


@contextlib.contextmanager
def tiny_vl_model(args: argparse.Namespace) -> Iterator[Path]:
    """The tiny random Qwen2.5-VL of the tests, written now (a few seconds)."""
    sys.path.insert(0, str(REPO))  # tests.helpers lives at the repository root
    from tests.helpers.tiny_vl import write_tiny_vl_model

    with tempfile.TemporaryDirectory(prefix="grpo_vl_") as tmp:
        model_dir = Path(args.model_dir or tmp)
        if not (model_dir / "config.json").is_file():
            write_tiny_vl_model(model_dir, seed=args.seed)
        yield model_dir


# -- rollouts ---------------------------------------------------------------------------
@dataclass
class ImageSample(Sample):
    picture: Picture | None = None


class VLEngine(InProcessEngine):
    """`AsyncLLM` on the vision-language checkpoint (engine core in a child process)."""

    def __init__(self, args: argparse.Namespace, loop: Loop, model_dir: Path) -> None:
        from hotswap import AsyncLLM
        from hotswap.weight_transfer import InProcessWeightSyncClient

        self.llm = AsyncLLM(str(model_dir), multiprocess=True, progress=False,
                            **engine_options(args))  # fmt: skip
        loop.run(self.llm.get_weight_info())  # starts the front-end on the loop thread
        self.weight_client = InProcessWeightSyncClient(self.llm)
        self.ids = iter(range(1 << 62))

    async def ask(
        self, image: Image.Image, params: SamplingParams
    ) -> tuple[list[int], list[Completion]]:
        """`params.n` answers about one image, with the prompt as the engine expanded it."""
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
        async for partial in self.llm.generate(prompt, params, request_id=f"r{next(self.ids)}"):
            out = partial  # cumulative: the last one is the whole completion
        return list(out.prompt_token_ids), completions(out)


async def rollout_batch(
    engine: VLEngine, pictures: list[Picture], params: list[SamplingParams], image_token: int
) -> tuple[list[Sample], float]:
    """Every group of the step at once; (samples with GRPO advantages, seconds). A
    completion holding the image placeholder (the tiny random policy may sample any id; a
    trained one never does) is dropped: the trainer would read it as an image slot."""
    start = asyncio.get_running_loop().time()
    groups = await asyncio.gather(*(engine.ask(p.image, sp) for p, sp in zip(pictures, params)))
    samples: list[Sample] = []
    for picture, (prompt_ids, group) in zip(pictures, groups):
        batch = [ImageSample(prompt_ids, c, reward(c.text, picture.colour), picture=picture)
                 for c in group if image_token not in c.token_ids]  # fmt: skip
        if not batch:
            continue
        rewards = torch.tensor([s.reward for s in batch])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for sample, advantage in zip(batch, advantages.tolist()):
            sample.advantage = advantage
        samples += batch
    return samples, asyncio.get_running_loop().time() - start


# -- the trainer ------------------------------------------------------------------------
class VLTrainer(Trainer):
    """The recipe's PPO-clip step on transformers' Qwen2.5-VL, vision tower frozen."""

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        from transformers import Qwen2_5_VLForConditionalGeneration
        from transformers.utils import logging

        logging.disable_progress_bar()
        self.args = args
        self.policy = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).train()
        self.policy.model.visual.requires_grad_(False)
        self.image_token = self.policy.config.image_token_id
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=args.lr, weight_decay=0.0)
        self.images: dict[str, torch.Tensor] = {}

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def _tensors(self, samples: list[Sample], version: int) -> dict[str, torch.Tensor]:
        """The recipe's token tensors; each row's image goes to the next forward."""
        pictures = [s.picture for s in samples]
        self.images = {
            "pixel_values": torch.from_numpy(
                np.concatenate([p.processed.pixel_values for p in pictures])
            ),
            "image_grid_thw": torch.tensor([p.processed.grid_thw for p in pictures]),
        }
        return super()._tensors(samples, version)

    def _logprobs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """log_softmax(logits / T) of each completion token, with the rows' images (M-RoPE
        positions from the image tokens; right padding never reaches a real token)."""
        mm_token_type_ids = (input_ids == self.image_token).int()
        hidden = self.policy.model(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids,
                                   **self.images).last_hidden_state  # fmt: skip
        index = positions[..., None].expand(-1, -1, hidden.shape[-1])
        logits = self.policy.lm_head(hidden.gather(1, index)).float() / self.args.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]

    def warm_up(self, task: ColourTask, prompt_ids: list[int], answers: list[list[int]]) -> float:
        """Supervised steps teaching the answer format only: each image is paired with
        every colour word, so the labels say nothing about the image. The last step's loss on
        the answer's first token (ln 3 for a model that says a colour word, any colour)."""
        optimizer = torch.optim.AdamW(self.trainable(), lr=self.args.warmup_lr)
        first = torch.tensor(0.0)
        for _ in range(self.args.warmup_steps):
            pictures = [task.draw() for _ in range(self.args.prompts_per_step)]
            samples: list[Sample] = [
                ImageSample(prompt_ids, Completion(ids, [0.0] * len(ids), [0] * len(ids), ""),
                            0.0, picture=picture)
                for picture in pictures for ids in answers
            ]  # fmt: skip
            batch = self._tensors(samples, 0)
            logp = self._logprobs(batch["input_ids"], batch["positions"], batch["targets"])
            loss = -(logp * batch["valid"]).sum() / len(samples)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            first = -logp[:, 0].detach().mean()  # ln 3 at best: the labels are a coin
        return first.item()


class LanguageModelSource(ModuleSource):
    """The policy's parameters without the frozen vision tower's: a partial round."""

    def metadata(self) -> list[ParamMeta]:
        return [m for m in super().metadata() if not m.name.startswith("model.visual.")]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in super().__iter__() if not n.startswith("model.visual."))


def push_sizes(policy: torch.nn.Module) -> dict[str, Any]:
    """What each push sends (the language model) and what it leaves (the tower), in MiB."""
    pushed = [t for _, t in LanguageModelSource(policy)]
    tower = [p for n, p in policy.named_parameters() if n.startswith("model.visual.")]
    return {"push_tensors": len(pushed), "push_mib": mib(pushed), "tower_mib": mib(tower)}


def mib(tensors: list[torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


# -- the loop ---------------------------------------------------------------------------
class VLGRPO(GRPO):
    """The recipe's one-step-off loop (run, push), with image prompts."""

    def __init__(self, args: argparse.Namespace, engine: VLEngine, loop: LoopThread,
                 trainer: VLTrainer, sync: TrainerWeightTransferEngine,
                 task: ColourTask) -> None:  # fmt: skip
        self.args, self.engine, self.loop = args, engine, loop
        self.trainer, self.sync, self.task = trainer, sync, task
        self.seeds = random.Random(args.seed)
        self.version = self.push("initial")  # the warmed-up language model

    def submit(self, step: int) -> concurrent.futures.Future:
        pictures = [self.task.draw() for _ in range(self.args.prompts_per_step)]
        params = [
            SamplingParams(
                n=self.args.group_size, temperature=self.args.temperature, top_p=1.0,
                top_k=0, max_tokens=self.args.max_tokens, logprobs=0,
                seed=self.seeds.randrange(1 << 31),  # the group's samples: seed, seed + 1, ...
            )
            for _ in pictures
        ]  # fmt: skip
        image = self.trainer.image_token
        return self.loop.submit(rollout_batch(self.engine, pictures, params, image))


def warm_up(args: argparse.Namespace, loop: LoopThread, engine: VLEngine, trainer: VLTrainer,
            task: ColourTask, model_dir: Path) -> None:  # fmt: skip
    """The format warm-up, on the prompt ids the engine itself expands."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    prompt_ids, _ = loop.run(engine.ask(task.draw().image, greedy))
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)  # the end of the turn
    answers = [tokenizer.encode(word, add_special_tokens=False) + end for word in COLOURS]
    loss = trainer.warm_up(task, prompt_ids, answers)
    print(f"warm-up: {args.warmup_steps} format-only steps, first-token loss {loss:.3f} "
          f"(ln 3 = {np.log(3):.3f}: a colour word, any colour)", flush=True)  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    trainer_cores, engine_cores = split_cores(args.trainer_threads, args.engine_threads)
    pin_process(trainer_cores)
    torch.set_num_threads(args.trainer_threads)
    torch.manual_seed(args.seed)
    loop = LoopThread()
    with contextlib.ExitStack() as stack:
        stack.callback(loop.close)
        model_dir = stack.enter_context(tiny_vl_model(args))
        with children_on(engine_cores, trainer_cores):
            engine = VLEngine(args, loop, model_dir)
        stack.callback(engine.close)
        task = ColourTask(model_dir, args.image_size, args.seed)
        trainer = VLTrainer(args, model_dir)
        warm_up(args, loop, engine, trainer, task, model_dir)
        sync = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(share_source=True), engine.weight_client,
            LanguageModelSource(trainer.policy),
        )  # fmt: skip
        stack.callback(sync.shutdown)
        pushed = push_sizes(trainer.policy)
        print(f"each push: {pushed['push_tensors']} tensors, {pushed['push_mib']:.2f} MiB (the "
              f"language model); the tower's {pushed['tower_mib']:.2f} MiB stays")  # fmt: skip
        records = VLGRPO(args, engine, loop, trainer, sync, task).run()
    rewards = [r.reward for r in records]
    window = max(1, min(10, len(rewards) // 3))  # the recipe's summary takes 3 steps each
    summary = {**summarize(args, records), **pushed,
               "reward_first_10": sum(rewards[:window]) / window,
               "reward_last_10": sum(rewards[-window:]) / window}  # fmt: skip
    print("summary: " + json.dumps(summary))
    if args.log_json:
        Path(args.log_json).write_text(json.dumps(
            {"summary": summary, "steps": [asdict(r) for r in records]}, indent=1
        ))  # fmt: skip
    return summary


if __name__ == "__main__":
    run(parse_args())
