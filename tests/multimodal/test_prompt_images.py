"""The front-end's image rules: vLLM's media flags parsed, processor overrides
(--mm-processor-kwargs and a request's mm_processor_kwargs), image counts, domains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hotswap.config import MediaConfig, media_config
from hotswap.errors import InvalidArgument
from hotswap.multimodal.prompt_images import PromptImages, prompt_images
from tests.helpers.tiny_vl import PREPROCESSOR

PAD = 5
CONFIG = {"vision_config": {"spatial_merge_size": 2}, "image_token_id": PAD}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return tmp_path


def _image(size: tuple[int, int] = (224, 224)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size, 3), np.uint8))


def test_media_flags_parse_as_vllms() -> None:
    assert media_config('{"image": 3}', None, None).limit_images == 3
    assert media_config({"image": {"count": 2}}, None, None).limit_images == 2
    assert media_config(None, None, None, '{"max_pixels": 1000}').processor_kwargs == {
        "max_pixels": 1000
    }
    for bad, field in [('{"image": -1}', "limit_mm_per_prompt"), ("[1]", "limit_mm_per_prompt"),
                       ("{", "limit_mm_per_prompt")]:  # fmt: skip
        with pytest.raises(InvalidArgument) as e:
            media_config(bad, None, None)
        assert e.value.field == field
    with pytest.raises(InvalidArgument) as e:
        media_config(None, None, None, "not json")
    assert e.value.field == "mm_processor_kwargs"


def test_processor_overrides_server_then_request(model_dir: Path) -> None:
    plain = PromptImages(model_dir, CONFIG, MediaConfig())
    small = PromptImages(model_dir, CONFIG, MediaConfig(processor_kwargs={"max_pixels": 56 * 56}))
    full = plain.process(_image(), "f").num_tokens
    assert small.process(_image(), "f").num_tokens < full
    assert plain.process(_image(), "f", {"max_pixels": 56 * 56}).num_tokens < full
    assert plain.process(_image(), "f", {"fps": 2}).num_tokens == full  # video-only: ignored
    with pytest.raises(InvalidArgument) as e:
        plain.process(_image(), "f", {"max_pixels": "many"})
    assert e.value.field == "mm_processor_kwargs.max_pixels"
    with pytest.raises(InvalidArgument) as e:
        plain.process(_image(), "f", {"min_pixels": 10**9, "max_pixels": 10})
    assert e.value.field == "mm_processor_kwargs"


def test_counts_domains_and_modalities(model_dir: Path) -> None:
    media = MediaConfig(limit_images=1, allowed_media_domains=("a.test",))
    images = PromptImages(model_dir, CONFIG, media)
    with pytest.raises(InvalidArgument, match="at most 1") as e:
        images.place([1, PAD, PAD], [_image(), _image()])
    assert e.value.field == "multi_modal_data"
    with pytest.raises(InvalidArgument, match="allowed-media-domains") as e:
        images.place([1, PAD], ["http://b.test/cat.png"])  # refused before any fetch
    assert e.value.field == "multi_modal_data.image[0]"
    assert prompt_images({"multi_modal_data": {"image": _image()}}) is not None
    with pytest.raises(InvalidArgument) as e:
        prompt_images({"multi_modal_data": {"video": [b""]}})
    assert e.value.field == "multi_modal_data.video"
    assert PromptImages.for_model(model_dir, {"vocab_size": 3}, MediaConfig()) is None
