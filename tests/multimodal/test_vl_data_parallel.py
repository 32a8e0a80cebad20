"""Images across process boundaries: two data-parallel engine cores in processes of their
own (the images cross ZMQ as msgspec structs) give one in-process engine's tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from PIL import Image

from hotswap import LLM, AsyncLLM, SamplingParams
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

pytestmark = pytest.mark.slow


def test_two_engine_processes_give_one_engines_tokens(tmp_path) -> None:  # noqa: ANN001
    model = str(write_tiny_vl_model(tmp_path / "model"))
    rng = np.random.default_rng(0)
    prompts = [{"prompt": f"<|im_start|>user\nPrompt {i} {IMAGE} x<|im_end|>\n"
                "<|im_start|>assistant\n", "multi_modal_data": {"image": Image.fromarray(
                    rng.integers(0, 255, (90, 60 + 30 * i, 3), dtype=np.uint8))}}
               for i in range(4)]  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def served() -> list:
        llm = AsyncLLM(model, multiprocess=True, data_parallel_size=2, dtype="float32",
                       progress=False)  # fmt: skip
        try:

            async def one(i: int) -> list[int]:
                outs = [out async for out in llm.generate(prompts[i], params, f"r{i}")]
                return list(outs[-1].outputs[0].token_ids)

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            llm.shutdown()

    reference = LLM(model, dtype="float32", progress=False).generate(prompts, params,
                                                                    use_tqdm=False)  # fmt: skip
    assert asyncio.run(served()) == [list(o.outputs[0].token_ids) for o in reference]
