"""hotswap.multimodal.images against transformers' Qwen2-VL image processor (the PIL one), and
load_image's refusals. No network: remote fetching is either off or served by a mock."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_resize,  # a copy of the torchvision module's, which needs torchvision
)

from hotswap.errors import InvalidArgument
from hotswap.multimodal.images import (
    ImageProcessorConfig,
    load_image,
    process_image,
    smart_resize,
)

FIELD = "messages[0].content[1].image_url"


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    shape = (height, width) if channels == 1 else (height, width, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


def palette(transparent: bool) -> Image.Image:
    image = noise(50, 70).quantize(colors=16)
    if transparent:
        image.info["transparency"] = 3
    return image


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def assert_matches_hf(image: Image.Image, hf_kwargs: dict[str, Any]) -> None:
    expected = Qwen2VLImageProcessorPil(**hf_kwargs)(images=image)
    got = process_image(image, ImageProcessorConfig.from_dict(hf_kwargs))
    assert got.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert got.pixel_values.dtype == np.float32
    assert got.pixel_values.shape == expected["pixel_values"].shape
    np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    t, h, w = got.grid_thw
    assert got.num_tokens == t * h * w // 4


IMAGE_IDS = ["37x91", "224", "640x480", "1000x30", "rgba", "la", "gray", "palette", "pal_t", "tiny"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: noise(37, 91),
        lambda: noise(224, 224),
        lambda: noise(640, 480),
        lambda: noise(1000, 30),
        lambda: noise(91, 37, "RGBA"),  # alpha composited over white
        lambda: noise(64, 48, "LA"),
        lambda: noise(80, 60, "L"),
        lambda: palette(transparent=False),
        lambda: palette(transparent=True),
        lambda: noise(10, 12),  # under min_pixels: upscaled
    ],
    ids=IMAGE_IDS,
)
def test_process_image_matches_transformers(make) -> None:
    assert_matches_hf(make(), {})


def test_small_max_pixels_downscales_as_transformers() -> None:
    image = noise(640, 480)
    assert_matches_hf(image, {"max_pixels": 28 * 28 * 16})
    got = process_image(image, ImageProcessorConfig(max_pixels=28 * 28 * 16))
    assert got.num_tokens <= 16 and got.grid_thw[1] * 14 * got.grid_thw[2] * 14 < 640 * 480


def test_other_settings_match_transformers() -> None:
    settings = {
        "size": {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 64},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.25, 0.5],
        "patch_size": 16,
        "temporal_patch_size": 3,
    }
    assert_matches_hf(noise(300, 200, seed=3), settings)
    assert_matches_hf(noise(300, 200, seed=3), {"do_normalize": False})
    assert_matches_hf(noise(300, 200, seed=3), {"do_rescale": False, "do_normalize": False})


SIDES = [1, 2, 13, 14, 27, 28, 29, 42, 55, 56, 57, 99, 224, 333, 1000, 1023, 4000, 9000]


@pytest.mark.parametrize(("min_pixels", "max_pixels"), [(56 * 56, 28 * 28 * 1280), (784, 12544)])
def test_smart_resize_matches_transformers(min_pixels: int, max_pixels: int) -> None:
    refused = 0
    for height in SIDES:
        for width in SIDES:
            try:
                expected = hf_resize(height, width, 28, min_pixels, max_pixels)
            except ValueError:
                refused += 1
                with pytest.raises(InvalidArgument, match="aspect ratio"):
                    smart_resize(height, width, 28, min_pixels, max_pixels)
                continue
            assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected
    assert refused > 0  # the grid holds ratios over 200


def test_smart_resize_refuses_empty_and_extreme_images() -> None:
    with pytest.raises(InvalidArgument):
        smart_resize(0, 10)
    with pytest.raises(InvalidArgument) as info:
        process_image(noise(402, 2), ImageProcessorConfig(), field=FIELD)
    assert info.value.field == FIELD and str(info.value).startswith(FIELD + ": ")


def test_from_dict_reads_both_key_styles(tmp_path: Path) -> None:
    qwen25 = {  # Qwen2.5-VL-3B-Instruct's preprocessor_config.json
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    config = ImageProcessorConfig.from_dict(qwen25)
    assert (config.min_pixels, config.max_pixels) == (3136, 12845056)
    by_size = ImageProcessorConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 9000}})
    assert (by_size.min_pixels, by_size.max_pixels) == (100, 9000)
    both = {"min_pixels": 200, "size": {"shortest_edge": 100, "longest_edge": 9000}}
    assert ImageProcessorConfig.from_dict(both).min_pixels == 200  # as transformers
    custom = ImageProcessorConfig.from_dict(
        {"patch_size": 16, "merge_size": 1, "image_mean": 0.5, "do_normalize": False}
    )
    assert (custom.patch_size, custom.merge_size, custom.factor) == (16, 1, 16)
    assert custom.image_mean == (0.5, 0.5, 0.5) and not custom.do_normalize
    assert ImageProcessorConfig.from_model_dir(tmp_path) == ImageProcessorConfig()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(qwen25))
    assert ImageProcessorConfig.from_model_dir(tmp_path) == config
    with pytest.raises(ValueError):
        ImageProcessorConfig(min_pixels=10, max_pixels=5)


def test_content_hash_follows_pixels() -> None:
    config = ImageProcessorConfig()
    image = noise(120, 90)
    first = process_image(image, config)
    assert process_image(image.copy(), config).content_hash == first.content_hash
    as_rgba = image.convert("RGBA")  # opaque: the same pixels in another mode
    assert process_image(as_rgba, config).content_hash == first.content_hash
    changed = image.copy()
    changed.putpixel((5, 5), tuple((v + 1) % 256 for v in changed.getpixel((5, 5))))
    assert process_image(changed, config).content_hash != first.content_hash
    assert process_image(noise(90, 120), config).content_hash != first.content_hash
    assert not first.pixel_values.flags.writeable


def refused(source: Any, **kwargs: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        load_image(source, field=FIELD, **kwargs)
    assert info.value.field == FIELD
    assert str(info.value).startswith(FIELD + ": ")
    return info.value


def data_url(payload: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


def test_load_image_accepts_every_source(tmp_path: Path) -> None:
    image = noise(33, 21)
    png = encoded(image)
    (tmp_path / "a.png").write_bytes(png)
    sources = [image, png, data_url(png), f"file://{tmp_path / 'a.png'}"]
    for source in sources:
        loaded = load_image(source, field=FIELD, allowed_local_media_path=str(tmp_path))
        assert loaded.size == (33, 21)
        assert np.array_equal(np.asarray(loaded), np.asarray(image))
    jpeg = load_image(encoded(image, "JPEG"), field=FIELD)
    assert jpeg.size == (33, 21) and jpeg.mode == "RGB"


def test_load_image_refuses_bad_bytes() -> None:
    png = encoded(noise(200, 150))  # noise: barely compressed, so cuts land in the pixels
    assert "not a readable image" in str(refused(b"this is just text\n"))
    for cut in (len(png) // 2, len(png) - 100):
        assert "cannot be decoded" in str(refused(png[:cut]))  # header parses, pixels fail
    refused(png[:40])
    refused(encoded(noise(64, 64), "JPEG")[:300])
    refused(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")  # EPS is not tried
    refused(12345)


def test_load_image_refuses_bad_data_urls() -> None:
    png = encoded(noise(8, 8))
    assert "base64" in str(refused("data:image/png;base64,not*base64!"))
    refused("data:image/png;base64," + base64.b64encode(png).decode()[:-3])  # bad padding
    refused("data:image/png," + png.hex())  # not base64
    refused(data_url(b"plain text", "text/plain"))


def test_load_image_refuses_too_many_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    image = noise(40, 30)
    assert "1200" in str(refused(encoded(image), max_image_pixels=1199))
    refused(image, max_image_pixels=1199)
    assert load_image(encoded(image), field=FIELD, max_image_pixels=1200).size == (40, 30)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL's own bomb check (over 2x)
    assert "too large" in str(refused(encoded(image), max_image_pixels=10**9))


def test_load_image_refuses_files_outside_the_allowed_path(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(encoded(noise(8, 8)))
    (allowed / "inside.png").write_bytes(encoded(noise(8, 8)))
    (allowed / "escape.png").symlink_to(outside)
    (allowed / "notes.txt").write_text("hello")
    kwargs = {"allowed_local_media_path": str(allowed)}
    assert load_image(f"file://{allowed / 'inside.png'}", field=FIELD, **kwargs).size == (8, 8)
    refused(f"file://{allowed / 'inside.png'}")  # no allowed path: no file URLs at all
    assert "outside" in str(refused(f"file://{outside}", **kwargs))
    assert "outside" in str(refused(f"file://{allowed / 'escape.png'}", **kwargs))
    assert "outside" in str(refused(f"file://{allowed}/../secret.png", **kwargs))
    refused(f"file://{allowed}", **kwargs)  # the directory itself
    refused("file://other-host/" + str(allowed / "inside.png"), **kwargs)
    assert "cannot read" in str(refused(f"file://{allowed / 'missing.png'}", **kwargs))
    refused(f"file://{allowed / 'notes.txt'}", **kwargs)


def test_load_image_remote_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    png = encoded(noise(12, 9))
    assert "remote" in str(refused("http://example.com/a.png"))
    refused("https://example.com/a.png")
    refused("ftp://example.com/a.png", allow_remote=True)
    refused("just a string", allow_remote=True)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/a.png":
            return httpx.Response(200, content=png)
        return httpx.Response(404)

    client = httpx.Client(transport=httpx.MockTransport(answer))
    monkeypatch.setattr(httpx, "stream", lambda method, url, **_: client.stream(method, url))
    got = load_image("http://example.com/a.png", field=FIELD, allow_remote=True)
    assert got.size == (12, 9)
    assert "404" in str(refused("http://example.com/missing.png", allow_remote=True))
