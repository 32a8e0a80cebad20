"""Images for Qwen2-VL / Qwen2.5-VL: a request's image read under vLLM's rules (`load_image`),
then resized, normalized and cut into patches as Hugging Face's `Qwen2VLImageProcessorPil`
does (`process_image`), with the same pixel values, grid and patch order."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
from PIL import Image

from hotswap.errors import InvalidArgument

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses images longer than this
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # below PIL's own decompression-bomb limit
# The formats a request may send, named to Image.open: others are never tried (EPS, for
# one, would run Ghostscript on the request's bytes).
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")
REMOTE_TIMEOUT_S = 10.0
MAX_REMOTE_BYTES = 64 << 20

ImageSource = Image.Image | bytes | str


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image processor's settings, with Qwen2-VL's defaults; `min_pixels`/`max_pixels`
    bound the resized image's area."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        sizes = (self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels)
        if min(sizes) < 1:
            raise ValueError(f"image processor sizes must be positive: {self}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels {self.max_pixels} < min_pixels {self.min_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0 in self.image_std:
            raise ValueError(f"image_mean/image_std need 3 values, std nonzero: {self}")

    @property
    def factor(self) -> int:
        """What both sides of a resized image are a multiple of (one merged patch)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ImageProcessorConfig:
        """From a Hugging Face `preprocessor_config.json`: `min_pixels`/`max_pixels` win over
        `size: {"shortest_edge", "longest_edge"}` (both mean pixel counts), as in
        transformers; keys it does not name keep their defaults."""
        size = d.get("size") or {}
        kwargs: dict[str, Any] = {}
        for name, size_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = d.get(name)
            value = size.get(size_key) if value is None else value
            if value is not None:
                kwargs[name] = int(value)
        for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if d.get(name) is not None:
                kwargs[name] = int(d[name])
        for name in ("image_mean", "image_std"):
            if d.get(name) is not None:
                value = d[name]
                values = value if isinstance(value, list | tuple) else [value] * 3
                kwargs[name] = tuple(float(v) for v in values)
        if d.get("rescale_factor") is not None:
            kwargs["rescale_factor"] = float(d["rescale_factor"])
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(name) is not None:
                kwargs[name] = bool(d[name])
        return cls(**kwargs)

    def with_overrides(self, kwargs: Mapping[str, Any], field: str) -> ImageProcessorConfig:
        """vLLM's `mm_processor_kwargs` for Qwen-VL models: `min_pixels`, `max_pixels`
        (or `size: {"shortest_edge", "longest_edge"}`) bound the resized area; other keys
        (a video's fps, ...) do not apply to images and are ignored, as the processor does.
        A bad value: InvalidArgument naming `field`."""
        size = kwargs.get("size") if isinstance(kwargs.get("size"), Mapping) else {}
        bounds = {"min_pixels": kwargs.get("min_pixels", size.get("shortest_edge")),
                  "max_pixels": kwargs.get("max_pixels", size.get("longest_edge"))}  # fmt: skip
        changes = {name: value for name, value in bounds.items() if value is not None}
        for name, value in changes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{field}.{name}", f"{field}.{name}: must be a positive "
                                      f"integer, got {value!r}")  # fmt: skip
        try:
            return dataclasses.replace(self, **changes)
        except ValueError as e:
            raise InvalidArgument(field, f"{field}: {e}") from None

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> ImageProcessorConfig:
        """From the model directory's `preprocessor_config.json`; the defaults without one."""
        file = Path(path) / PREPROCESSOR_CONFIG_FILE
        if not file.is_file():
            return cls()
        return cls.from_dict(json.loads(file.read_text()))


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as the vision tower takes it. `pixel_values` (read-only) is float32
    [grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2] in Hugging Face's
    patch order; `content_hash` is the same for any two images with the same pixels."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    merge_size: int
    content_hash: str

    @property
    def num_tokens(self) -> int:
        """The placeholder tokens this image takes in the prompt (after patch merging)."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """(height, width) nearest the image's with both a multiple of `factor` and their product
    within [min_pixels, max_pixels] (aspect ratio kept as well as that allows); transformers'
    qwen2_vl `smart_resize`, its refusals as InvalidArgument (field None: the caller's)."""
    if height < 1 or width < 1:
        raise InvalidArgument(None, f"a {width}x{height} image has no pixels")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidArgument(
            None, f"absolute aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def process_image(
    image: Image.Image, config: ImageProcessorConfig, *, field: str = "image"
) -> ProcessedImage:
    """What `Qwen2VLImageProcessorPil` makes of one image: RGB (transparency over white),
    resized to `smart_resize`'s size, rescaled, normalized, repeated to
    `temporal_patch_size` frames and cut into patches. A refused image raises
    InvalidArgument naming `field`."""
    rgb = _to_rgb(image) if config.do_convert_rgb else image
    if rgb.mode != "RGB":
        raise InvalidArgument(field, f"{field}: mode {rgb.mode} is not RGB (do_convert_rgb off)")
    width, height = rgb.size
    if config.do_resize:
        try:
            height, width = smart_resize(
                height, width, config.factor, config.min_pixels, config.max_pixels
            )
        except InvalidArgument as e:
            raise InvalidArgument(field, f"{field}: {e}") from None
        rgb = rgb.resize((width, height), resample=config.resample)
    elif height % config.factor or width % config.factor:
        raise InvalidArgument(
            field, f"{field}: {width}x{height} is not a multiple of {config.factor} (no resize)"
        )
    pixels: np.ndarray = np.asarray(rgb)  # [H, W, C] uint8
    if config.do_rescale:  # in float64, then float32, as transformers' rescale
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        if not np.issubdtype(pixels.dtype, np.floating):
            pixels = pixels.astype(np.float32)
        mean = np.array(config.image_mean, dtype=pixels.dtype)
        std = np.array(config.image_std, dtype=pixels.dtype)
        pixels = (pixels - mean) / std
    patches = _patchify(pixels.astype(np.float32, copy=False), config)
    grid = (1, height // config.patch_size, width // config.patch_size)
    patches.setflags(write=False)
    return ProcessedImage(patches, grid, config.merge_size, _content_hash(patches, grid))


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparent pixels composited over white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _patchify(pixels: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """[H, W, C] -> [grid_h * grid_w, C * T * P * P]: patches ordered by merge window (row
    major), then row major inside each window; in each patch channel, then frame (the one
    image repeated T times), then row, then column."""
    height, width, channels = pixels.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    # -> (grid_h/m, grid_w/m, m_h, m_w, C, p_h, p_w)
    patches = patches.transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(
        patches[:, :, :, :, :, None], (*patches.shape[:5], t, *patches.shape[5:])
    )
    return np.ascontiguousarray(frames.reshape(grid_h * grid_w, channels * t * p * p))


def _content_hash(pixel_values: np.ndarray, grid: tuple[int, int, int]) -> str:
    digest = hashlib.blake2b(digest_size=32)
    digest.update(repr((grid, pixel_values.shape, pixel_values.dtype.str)).encode())
    digest.update(np.ascontiguousarray(pixel_values).data)
    return digest.hexdigest()


def load_image(
    source: ImageSource,
    *,
    field: str,
    allowed_local_media_path: str | os.PathLike[str] | None = None,
    allow_remote: bool = False,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Image.Image:
    """A request's image, fully decoded. `source`: a PIL image, the file's bytes, a base64
    `data:` URL, a `file://` URL inside `allowed_local_media_path` (symlinks and `..`
    resolved first), or an `http(s)://` URL when `allow_remote`. Anything else, and any
    image that does not decode or has more than `max_image_pixels` pixels, raises
    InvalidArgument(field, "<field>: ...")."""
    if isinstance(source, Image.Image):
        _check_pixels(source, field, max_image_pixels)
        return _loaded(source, field)
    if isinstance(source, bytes | bytearray | memoryview):
        return _decode(io.BytesIO(bytes(source)), field, max_image_pixels)
    if not isinstance(source, str):
        kind = type(source).__name__
        raise InvalidArgument(field, f"{field}: expected an image or an image URL, got {kind}")
    scheme = urlparse(source).scheme.lower() if ":" in source else ""
    if scheme == "data":
        return _decode(io.BytesIO(_data_url_bytes(source, field)), field, max_image_pixels)
    if scheme == "file":
        path = _local_path(source, field, allowed_local_media_path)
        try:
            file = path.open("rb")
        except OSError as e:
            raise InvalidArgument(field, f"{field}: cannot read {path}: {e.strerror}") from None
        with file:
            return _decode(file, field, max_image_pixels)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise InvalidArgument(field, f"{field}: fetching remote images is disabled")
        return _decode(io.BytesIO(_fetch(source, field)), field, max_image_pixels)
    raise InvalidArgument(
        field, f"{field}: expected a data:, file:// or http(s):// URL, got {_brief(source)}"
    )


def _brief(text: str, limit: int = 64) -> str:
    """`text` for a message, cut short (a data URL can be megabytes)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _data_url_bytes(url: str, field: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise InvalidArgument(field, f"{field}: only base64 data URLs are supported")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except ValueError as e:  # binascii.Error, or non-ASCII characters
        raise InvalidArgument(field, f"{field}: invalid base64 in the data URL: {e}") from None


def _local_path(url: str, field: str, allowed: str | os.PathLike[str] | None) -> Path:
    """The file a `file://` URL names, if it lies inside `allowed` once resolved."""
    if allowed is None:
        raise InvalidArgument(
            field, f"{field}: file:// URLs are refused (no allowed local media path is set)"
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidArgument(field, f"{field}: file URL host {parsed.netloc!r} is not local")
    path = Path(url2pathname(parsed.path))
    root = Path(allowed).resolve()
    resolved = path.resolve()
    if not path.is_absolute() or root not in resolved.parents:
        raise InvalidArgument(
            field, f"{field}: {_brief(str(path))} is outside the allowed local media path"
        )
    return resolved


def _fetch(url: str, field: str) -> bytes:
    import httpx  # only for remote images, which are off by default

    chunks: list[bytes] = []
    received = 0
    try:
        with httpx.stream("GET", url, timeout=REMOTE_TIMEOUT_S, follow_redirects=True) as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                received += len(chunk)
                if received > MAX_REMOTE_BYTES:
                    raise InvalidArgument(
                        field, f"{field}: {_brief(url)} is over {MAX_REMOTE_BYTES} bytes"
                    )
                chunks.append(chunk)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise InvalidArgument(field, f"{field}: fetching {_brief(url)} failed: {e}") from None
    return b"".join(chunks)


def _check_pixels(image: Image.Image, field: str, max_image_pixels: int) -> None:
    width, height = image.size
    if width * height > max_image_pixels:
        raise InvalidArgument(
            field,
            f"{field}: a {width}x{height} image has {width * height} pixels, over the limit "
            f"of {max_image_pixels}",
        )


def _decode(stream: IO[bytes], field: str, max_image_pixels: int) -> Image.Image:
    """Open (the header alone), check the size, then decode every pixel."""
    try:
        image = Image.open(stream, formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise InvalidArgument(field, f"{field}: image too large: {e}") from None
    except Exception as e:  # whatever a decoder raises on foreign bytes
        raise InvalidArgument(field, f"{field}: not a readable image: {e}") from None
    _check_pixels(image, field, max_image_pixels)
    return _loaded(image, field)


def _loaded(image: Image.Image, field: str) -> Image.Image:
    try:
        image.load()  # a truncated or corrupt file fails here, not in the processor
    except Image.DecompressionBombError as e:
        raise InvalidArgument(field, f"{field}: image too large: {e}") from None
    except Exception as e:  # whatever a decoder raises on foreign bytes
        raise InvalidArgument(field, f"{field}: image cannot be decoded: {e}") from None
    return image
