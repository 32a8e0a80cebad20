"""Qwen2.5-VL and Qwen3-VL through the engine against transformers on the same checkpoint: greedy
tokens and logprobs with images of different sizes, chunked prefill across an image,
prefix-cache hits keyed by the image, bad images refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hotswap import LLM, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.multimodal.images import ImageProcessorConfig, process_image
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return write_tiny_vl_model(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: ANN001, ANN201
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt(images: list[Image.Image], text: str = "The quick brown fox") -> dict:
    body = " ".join([text] + [IMAGE] * len(images)) + " jumps over"
    return {"prompt": f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": {"image": images}}  # fmt: skip


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True)


def _hf_generate(model, model_dir, prompt_ids: list[int], images: list[Image.Image]):  # noqa: ANN001, ANN202
    """transformers' greedy tokens and their logprobs for the engine's expanded prompt."""
    config = ImageProcessorConfig.from_model_dir(model_dir)
    processed = [process_image(image, config) for image in images]
    ids = torch.tensor([prompt_ids])
    pixels = {}
    if processed:
        pixels = dict(
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in processed])),
            image_grid_thw=torch.tensor([p.grid_thw for p in processed]),
        )
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **pixels)  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def _check_against_reference(llm, reference, model_dir, prompts, image_lists) -> list:  # noqa: ANN001
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for out, images in zip(outs, image_lists):
        tokens, logprobs = _hf_generate(reference, model_dir, out.prompt_token_ids, images)
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        ours = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-4)
    return outs


def test_images_of_different_sizes_in_one_batch(model_dir, reference) -> None:  # noqa: ANN001
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256)
    image_lists = [[_image(0, (90, 120))], [_image(1, (60, 200)), _image(2, (150, 70))],
                   [_image(3, (224, 224))], []]  # fmt: skip
    prompts = [_prompt(images) for images in image_lists]
    outs = _check_against_reference(llm, reference, model_dir, prompts, image_lists)
    # the images decide the tokens: another image, other tokens (here, and in transformers)
    other = _check_against_reference(llm, reference, model_dir, [_prompt([_image(9, (90, 120))])],
                                     [[_image(9, (90, 120))]])  # fmt: skip
    assert other[0].outputs[0].token_ids != outs[0].outputs[0].token_ids
    assert llm.engine.runner.images.encoded_images == 5


def test_chunked_prefill_across_an_image_and_prefix_hits(model_dir, reference) -> None:  # noqa: ANN001
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
              max_num_batched_tokens=24, max_num_seqs=1)  # fmt: skip
    images = [_image(4, (200, 150))]  # 40 image tokens: chunks cut through it
    first = _check_against_reference(llm, reference, model_dir, [_prompt(images)], [images])
    assert first[0].num_cached_tokens == 0
    encoded = llm.engine.runner.images.encoded_images
    assert encoded == 1  # once, though three chunks read it
    again = _check_against_reference(llm, reference, model_dir, [_prompt(images)], [images])
    ids = again[0].prompt_token_ids
    image_end = len(ids) - ids[::-1].index(reference.config.image_token_id)
    assert again[0].num_cached_tokens >= image_end // 16 * 16 > 16  # the image's blocks too
    # the same text with another image of the same size shares only the blocks before it
    other = [_image(5, (200, 150))]
    out = _check_against_reference(llm, reference, model_dir, [_prompt(other)], [other])
    image_start = out[0].prompt_token_ids.index(reference.config.image_token_id)
    assert out[0].num_cached_tokens == image_start // 16 * 16


def test_bad_images_are_refused(model_dir, tmp_path) -> None:  # noqa: ANN001
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64,
              limit_mm_per_prompt='{"image": 2}')  # fmt: skip
    (tmp_path / "note.txt").write_text("not an image")
    cases = {
        "multi_modal_data.image[0]": _prompt(["data:image/png;base64,bm90IGFuIGltYWdl"]),
        "multi_modal_data": _prompt([_image(0, (90, 90))] * 3),  # over the limit
    }
    remote = _prompt(["http://example.com/cat.png"])
    cases["multi_modal_data.image[0]"] = remote
    for field, prompt in cases.items():
        with pytest.raises(InvalidArgument) as e:
            llm.generate([prompt], _greedy(), use_tqdm=False)
        assert e.value.field == field, e.value
    # two images, one placeholder
    prompt = _prompt([_image(0, (90, 90))])
    prompt["multi_modal_data"]["image"].append(_image(1, (90, 90)))
    with pytest.raises(InvalidArgument, match="placeholder"):
        llm.generate([prompt], _greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == 64  # nothing was admitted
    assert llm.generate([_prompt([_image(0, (90, 90))])], _greedy(), use_tqdm=False)
