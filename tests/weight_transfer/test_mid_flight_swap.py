"""The validation that matters (vLLM's rlhf_async example, as a test): an engine on weights
V1 streams 8 greedy requests; once any has 10 tokens it pauses in keep mode, takes V2 from
a trainer over gloo, and resumes. A fresh engine loaded with V2, continuing each request
from its prompt + pre-pause tokens, must produce exactly the post-resume tokens."""

from __future__ import annotations

import asyncio

import pytest

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.outputs import CompletionOutput
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port, trainer_model

# Engines (one in a process of its own), seconds each: slow.
pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "Reinforcement learning trains a policy",
    "Paged attention stores keys",
    "Pause, swap the weights, resume",
    "Numbers 0123456789 and symbols",
    "你好世界",
    "The lazy dog",
    "Blocks of keys and values",
]
MAX_TOKENS = 48
ENGINE = {"dtype": "float32", "batch_invariant": True, "block_size": 8, "progress": False}


async def swap_mid_flight(llm: AsyncLLM, trainer, clear_cache: bool) -> list[CompletionOutput]:  # noqa: ANN001
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    latest: dict[int, CompletionOutput] = {}
    reached = asyncio.Event()

    async def stream(i: int) -> None:
        async for out in llm.generate(PROMPTS[i], params, request_id=f"r{i}"):
            latest[i] = out.outputs[0]
            if len(latest[i].token_ids) >= 10:
                reached.set()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(reached.wait(), 60)
    await llm.pause_generation(mode="keep", clear_cache=clear_cache)
    await asyncio.to_thread(trainer.send_weights, "v2")
    await llm.resume_generation()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return [latest[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("clear_cache", [True, False])
def test_post_resume_tokens_match_a_fresh_v2_engine(clear_cache, arch, tiny_model_factory):
    v1_dir, v2_dir = tiny_model_factory(arch, seed=0), tiny_model_factory(arch, seed=1)
    v2_trainer = trainer_model(v2_dir)  # a mixture of experts sends them stacked

    async def run() -> tuple[list[CompletionOutput], list[list[int]]]:
        llm = AsyncLLM(str(v1_dir), weight_transfer_config={"backend": "gloo"}, **ENGINE)
        try:
            await llm.get_weight_version()  # binds the engine to this event loop
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            client = InProcessWeightSyncClient(llm)
            trainer = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init, info, client, ModuleSource(v2_trainer)
            )
            outputs = await swap_mid_flight(llm, trainer, clear_cache)
            prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        finally:
            llm.shutdown()
        return outputs, prompt_ids

    outputs, prompt_ids = asyncio.run(run())
    fresh = LLM(str(v2_dir), dtype="float32", batch_invariant=True, block_size=8, progress=False)
    swapped = 0
    for output, ids in zip(outputs, prompt_ids):
        spans = output.weight_versions
        assert [s.version for s in spans] in ([0, 1], [1]) or spans[0].end == MAX_TOKENS
        assert spans[0].start == 0 and spans[-1].end == MAX_TOKENS == len(output.token_ids)
        boundary = next((s.start for s in spans if s.version == 1), MAX_TOKENS)
        if boundary == MAX_TOKENS:
            continue  # finished before the pause
        swapped += 1
        assert all(s.stale == (not clear_cache and s.version == 1) for s in spans)
        if not clear_cache:
            continue  # stale KV: a fresh V2 engine would attend to different context
        pre, post = output.token_ids[:boundary], output.token_ids[boundary:]
        cont = SamplingParams(temperature=0.0, max_tokens=len(post), ignore_eos=True)
        again = fresh.generate([{"prompt_token_ids": ids + pre}], cont, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == post, f"request {ids}: diverged after the swap"
    assert swapped >= 7  # all but, at most, one that finished early
