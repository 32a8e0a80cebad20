"""A vision-language model's decode steps through the compiled graphs: their three M-RoPE
axes agree, so they run as plain RoPE at the shifted positions; tokens and logprobs equal
the eager engine's, and steps that read images stay eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hotswap import LLM, SamplingParams
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

# Compiles decode graphs for engines in this process: slow (as tests/execution/test_compiled.py)
pytestmark = pytest.mark.slow


@pytest.fixture
def compiling():  # noqa: ANN201
    with torch._dynamo.config.patch(disable=False):
        yield


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_compiled_decode_equals_eager(compiling, family: str, tmp_path) -> None:  # noqa: ANN001
    model_dir = write_tiny_vl_model(tmp_path / family, family=family)
    rng = np.random.default_rng(0)
    prompts = [{"prompt": f"<|im_start|>user\nThe {IMAGE} quick {i}<|im_end|>\n"
                "<|im_start|>assistant\n",
                "multi_modal_data": {"image": Image.fromarray(
                    rng.integers(0, 255, (90, 100 + 30 * i, 3), dtype=np.uint8))}}
               for i in range(3)]  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=0, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(str(model_dir), dtype="float32", enforce_eager=eager, progress=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [o.outputs[0] for o in outs]
        if not eager:
            stats = llm.engine.stats.get_stats()
            assert stats["compiled_decode_steps"] >= 20  # every decode step
        llm.shutdown()
    for compiled, eager in zip(results[False], results[True]):
        assert compiled.token_ids == eager.token_ids
        ours = [entry[t].logprob for entry, t in zip(compiled.logprobs, compiled.token_ids)]
        theirs = [entry[t].logprob for entry, t in zip(eager.logprobs, eager.token_ids)]
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
