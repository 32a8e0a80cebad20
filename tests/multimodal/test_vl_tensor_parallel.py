"""A vision-language model on two tensor-parallel ranks: the decoder split as a text
model's, the vision tower whole on each rank (each encodes the step's images); greedy
tokens and logprobs equal one rank's, and a round of both towers in transformers' names
equals a fresh one-rank engine on the new weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hotswap import LLM, SamplingParams
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

# Engines with a worker process each: slow.
pytestmark = pytest.mark.slow


def _prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    sizes = [(90, 120, 3), (60, 200, 3), (150, 70, 3)]
    return [{"prompt": f"<|im_start|>user\nPrompt {i} {IMAGE} jumps<|im_end|>\n"
             "<|im_start|>assistant\n", "multi_modal_data": {"image": Image.fromarray(
                 rng.integers(0, 255, size, dtype=np.uint8))}}
            for i, size in enumerate(sizes)]  # fmt: skip


def _run(llm: LLM) -> list:
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _assert_same(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        ours = [entry[t].logprob for entry, t in zip(a.logprobs, a.token_ids)]
        theirs = [entry[t].logprob for entry, t in zip(b.logprobs, b.token_ids)]
        np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_two_ranks_equal_one_and_take_rounds(tmp_path, family: str) -> None:  # noqa: ANN001
    import transformers

    v1 = write_tiny_vl_model(tmp_path / "v1", seed=0, family=family)
    v2 = write_tiny_vl_model(tmp_path / "v2", seed=1, family=family)
    args = dict(dtype="float32", max_num_batched_tokens=32, progress=False)
    one = _run(LLM(str(v1), **args))
    two = LLM(str(v1), tensor_parallel_size=2, **args)
    try:
        _assert_same(_run(two), one)
        trainer = transformers.AutoModelForImageTextToText.from_pretrained(v2, dtype=torch.float32)
        two.load_weights_inline({n: p.detach() for n, p in trainer.named_parameters()}, "v2")
        _assert_same(_run(two), _run(LLM(str(v2), **args)))
    finally:
        two.shutdown()
