"""Weight rounds into a vision-language model: a mid-flight swap of both towers (keep
mode, clear_cache) equals a fresh engine on the new weights, image embeddings re-encoded
by the new tower; a round of the language model alone leaves the tower as it was. The
rounds carry transformers' own parameter names (model.language_model.*, model.visual.*)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import torch
from PIL import Image

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.outputs import CompletionOutput
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model
from tests.weight_transfer.conftest import free_port

pytestmark = pytest.mark.slow
MAX_TOKENS = 32
ENGINE = {"dtype": "float32", "batch_invariant": True, "block_size": 8, "progress": False}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root, family = tmp_path_factory.mktemp("vl_rounds"), request.param
    return (write_tiny_vl_model(root / "v1", seed=0, family=family),
            write_tiny_vl_model(root / "v2", seed=1, family=family))  # fmt: skip


def _trainer_tensors(model_dir) -> dict[str, torch.Tensor]:  # noqa: ANN001
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i, size in enumerate([(90, 120), (60, 200), (150, 70), (90, 90)]):
        image = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
        text = f"<|im_start|>user\nPrompt {i} {IMAGE} jumps<|im_end|>\n<|im_start|>assistant\n"
        out.append({"prompt": text, "multi_modal_data": {"image": [image]}})
    return out


async def _swap_mid_flight(
    llm: AsyncLLM, swap: Callable[[], Awaitable], max_tokens: int = MAX_TOKENS
) -> list[tuple[list[int], CompletionOutput]]:
    """Streams every prompt; once one has 8 tokens, `swap()` runs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    latest: dict[int, tuple[list[int], CompletionOutput]] = {}
    reached = asyncio.Event()

    async def stream(i: int, prompt: dict) -> None:
        async for out in llm.generate(prompt, params, request_id=f"r{i}"):
            latest[i] = (list(out.prompt_token_ids), out.outputs[0])
            if len(out.outputs[0].token_ids) >= 8:
                reached.set()

    prompts = _prompts()
    tasks = [asyncio.ensure_future(stream(i, p)) for i, p in enumerate(prompts)]
    await asyncio.wait_for(reached.wait(), 60)
    await swap()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return [latest[i] for i in range(len(prompts))]


def _check_against_fresh(v2_dir, results: list) -> None:  # noqa: ANN001
    """Each continuation after the switch equals a fresh V2 engine fed prompt + tokens."""
    fresh = LLM(str(v2_dir), **ENGINE)
    images = [p["multi_modal_data"]["image"] for p in _prompts()]
    swapped = 0
    for (prompt_ids, output), image in zip(results, images):
        total = len(output.token_ids)
        boundary = next((s.start for s in output.weight_versions if s.version == 1), total)
        if boundary in (0, total):
            continue
        swapped += 1
        pre, post = output.token_ids[:boundary], output.token_ids[boundary:]
        cont = SamplingParams(temperature=0.0, max_tokens=len(post), ignore_eos=True)
        prompt = {"prompt_token_ids": prompt_ids + list(pre), "multi_modal_data": {"image": image}}
        again = fresh.generate([prompt], cont, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == post, "diverged after the swap"
    assert swapped >= 3


def test_a_mid_flight_swap_of_both_towers_equals_a_fresh_engine(dirs) -> None:  # noqa: ANN001
    v1_dir, v2_dir = dirs
    tensors = _trainer_tensors(v2_dir)
    assert any(name.startswith("model.visual.") for name in tensors)

    async def run() -> list:
        llm = AsyncLLM(str(v1_dir), **ENGINE)

        async def swap() -> None:
            await llm.pause_generation(mode="keep", clear_cache=True)
            await llm.load_weights_inline(tensors, "v2")
            await llm.resume_generation()

        try:
            return await _swap_mid_flight(llm, swap)
        finally:
            llm.shutdown()

    _check_against_fresh(v2_dir, asyncio.run(run()))


def test_an_in_flight_round_recomputes_with_the_new_tower(dirs) -> None:  # noqa: ANN001
    """No pause: a trainer's gloo round lands between two steps; running requests
    recompute (kv_policy recompute), their images re-encoded by the new tower."""
    import transformers

    v1_dir, v2_dir = dirs
    trainer_model = transformers.AutoModelForImageTextToText.from_pretrained(
        v2_dir, dtype=torch.float32
    )
    config = {"backend": "gloo", "in_flight": True, "kv_policy": "recompute"}

    async def run() -> list:
        llm = AsyncLLM(str(v1_dir), weight_transfer_config=config, **ENGINE)
        try:
            await llm.get_weight_version()
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            trainer = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init, info,
                InProcessWeightSyncClient(llm), ModuleSource(trainer_model),
            )  # fmt: skip
            # more tokens: the round must land while most streams still run (a loaded
            # host may take a while to commit it)
            return await _swap_mid_flight(
                llm, lambda: asyncio.to_thread(trainer.send_weights, "v2"), max_tokens=160
            )
        finally:
            llm.shutdown()

    _check_against_fresh(v2_dir, asyncio.run(run()))


def test_a_language_model_round_leaves_the_vision_tower(dirs) -> None:  # noqa: ANN001
    v1_dir, v2_dir = dirs
    text_only = {n: t for n, t in _trainer_tensors(v2_dir).items() if "visual" not in n}
    llm = LLM(str(v1_dir), **ENGINE)
    before = _checksums(llm)
    llm.load_weights_inline(text_only, "lm-only")
    after = _checksums(llm)
    changed = {name for name in before if before[name] != after[name]}
    assert changed and not any(name.startswith("visual.") for name in changed)
    assert all(name.startswith(("model.", "lm_head")) for name in changed)
    # the vision tower's tensors under transformers' names land in the tower
    vision = {n: t for n, t in _trainer_tensors(v2_dir).items() if "visual" in n}
    llm.load_weights_inline(vision, "both")
    final = _checksums(llm)
    assert {n for n in before if before[n] != final[n]} == set(before)


def _checksums(llm: LLM) -> dict[str, str]:
    """Parameter name -> SHA-256 (vLLM's keys carry the rank before the name)."""
    sums = llm.call("get_weight_checksums")
    return {key.rsplit(":", 1)[1]: value for key, value in sums.items()}
