"""Swap weights in the middle of 8 streaming rollouts, in process, and see which tokens
came from which weights.

An `AsyncLLM` serves the built-in SmolLM2-135M-Instruct and streams 8 greedy chat
rollouts. As soon as one has 10 tokens, the RL loop pauses generation in place
(`mode="keep"`, KV cache cleared), a trainer-side model broadcasts its weights over gloo
through the in-process client, and generation resumes. No request is lost: each finishes,
and its `CompletionOutput.weight_versions` spans say which output tokens each weight
version produced.

So that the change is easy to see, the trainer's "trained" policy is the same model with
the embedding row of every lowercase word token swapped with its all-capitals twin ("the"
<-> "THE"). The embeddings are tied, so this only relabels tokens: the new policy writes
the same kind of answer, in capitals. The old-weight part of each rollout is lowercase,
the new-weight part shouts, and the switch happens exactly at the span boundary.

Trainer code is blocking, so it runs on a worker thread (`asyncio.to_thread`) while the
event loop keeps serving the engine.

    .venv/bin/python examples/rlhf_async.py
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import tokenizers
import torch

from hotswap import AsyncLLM, SamplingParams
from hotswap.default_model import default_model_dir
from hotswap.outputs import RequestOutput
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2+2?",
    "Describe a cat in one sentence.",
    "What does a plant need to grow?",
    "What colour is the sky?",
    "What is the largest planet?",
    "Give me a word that rhymes with blue.",
]
PAUSE_AFTER_TOKENS = 10


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shouting_pairs(tokenizer_json: Path) -> list[tuple[int, int]]:
    """(id of "word", id of "WORD") for every lowercase word token with a capitals twin."""
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_json)).get_vocab()
    word = re.compile(r"^\u0120?[a-z]{2,}$")  # byte-level BPE writes a leading space as U+0120
    return [(i, vocab[t.upper()]) for t, i in vocab.items() if word.match(t) and t.upper() in vocab]


@torch.no_grad()
def load_trainer_model() -> torch.nn.Module:
    """The built-in model, "trained" to shout (see the module docstring)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    path = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pairs = torch.tensor(shouting_pairs(path / "tokenizer.json"))
    embed = model.get_input_embeddings().weight
    embed[torch.cat([pairs[:, 0], pairs[:, 1]])] = embed[torch.cat([pairs[:, 1], pairs[:, 0]])]
    print(f"trainer: swapped {len(pairs)} lowercase/CAPITALS token pairs")
    return model


async def rollout(llm: AsyncLLM, i: int, started: asyncio.Event) -> RequestOutput:
    """One streaming request; sets `started` once it has PAUSE_AFTER_TOKENS tokens."""
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i]}])
    params = SamplingParams(temperature=0.0, max_tokens=48)
    async for out in llm.generate(prompt, params, request_id=f"rollout-{i}"):
        if len(out.outputs[0].token_ids) >= PAUSE_AFTER_TOKENS:
            started.set()
    return out


async def swap_weights(llm: AsyncLLM, trainer: TrainerWeightTransferEngine) -> None:
    """Pause in place, send a full round from the trainer thread, resume."""
    start = time.perf_counter()
    await llm.pause_generation(mode="keep", clear_cache=True)
    paused = time.perf_counter()
    await asyncio.to_thread(trainer.send_weights, "trained")
    synced = time.perf_counter()
    await llm.resume_generation()
    print(f"pause {1000 * (paused - start):.0f} ms, sync {1000 * (synced - paused):.0f} ms, "
          f"resume {1000 * (time.perf_counter() - synced):.0f} ms; "
          f"engine now at {await llm.get_weight_version()}")  # fmt: skip


def report(llm: AsyncLLM, outputs: list[RequestOutput]) -> None:
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        print(f"\n[{out.request_id}] {QUESTIONS[i]} ({completion.finish_reason})")
        for span in completion.weight_versions:
            text = llm.tokenizer.decode(completion.token_ids[span.start : span.end])
            print(f"  v{span.version} {span.label!r:>10} tokens [{span.start:2d}, {span.end:2d}): "
                  f"{text!r}")  # fmt: skip


async def main() -> None:
    llm = AsyncLLM(
        batch_invariant=True,
        weight_transfer_config={"backend": "gloo"},
        progress=False,
    )
    model = load_trainer_model()
    try:
        print(f"engine weights: {await llm.get_weight_version()}")  # also starts the engine
        started = asyncio.Event()
        tasks = [asyncio.create_task(rollout(llm, i, started)) for i in range(len(QUESTIONS))]
        # Join the gloo group while the rollouts run (engine world size 1 + this trainer).
        info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
        client = InProcessWeightSyncClient(llm)
        trainer = await asyncio.to_thread(
            WeightTransferTrainerFactory.trainer_init, info, client, ModuleSource(model)
        )
        await started.wait()
        await swap_weights(llm, trainer)
        report(llm, await asyncio.gather(*tasks))
        trainer.shutdown()
    finally:
        llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
