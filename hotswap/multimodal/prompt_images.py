"""The front-end's part of a prompt's images: load each one (multimodal/images.py), turn
it into patches as the checkpoint's image processor does, and expand its placeholder in
the prompt's token ids exactly once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hotswap.config import MediaConfig
from hotswap.errors import InvalidArgument
from hotswap.multimodal.images import (
    ImageProcessorConfig,
    ProcessedImage,
    load_image,
    process_image,
)
from hotswap.multimodal.placement import PlacedImage, expand_placeholders

FIELD = "multi_modal_data"


def prompt_images(prompt: object) -> list[Any] | None:
    """The images of a prompt dict's `multi_modal_data` (vLLM's: {"image": one or a
    list}); None when it has none."""
    data = prompt.get(FIELD) if isinstance(prompt, dict) else None
    if data is None:
        return None
    if not isinstance(data, dict):
        raise InvalidArgument(FIELD, f"{FIELD}: must be a dict of modality -> items")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InvalidArgument(f"{FIELD}.{unknown[0]}", f"{FIELD}.{unknown[0]}: only images "
                              f"are supported")  # fmt: skip
    images = data.get("image")
    if images is None:
        return None
    return list(images) if isinstance(images, (list, tuple)) else [images]


class PromptImages:
    """A multimodal model's image front-end, with the server's media limits (vLLM's
    --limit-mm-per-prompt, --allowed-local-media-path, --allowed-media-domains)."""

    def __init__(self, model_dir: Path, hf_config: dict[str, Any], media: MediaConfig) -> None:
        processor = ImageProcessorConfig.from_model_dir(model_dir)
        self.processor = processor.with_overrides(media.processor_kwargs, "mm_processor_kwargs")
        self.token_id = int(hf_config["image_token_id"])
        self.media = media

    @classmethod
    def for_model(cls, model_dir: Path, hf_config: dict[str, Any],
                  media: MediaConfig) -> PromptImages | None:  # fmt: skip
        """None for a model that takes no images."""
        if "vision_config" not in hf_config or "image_token_id" not in hf_config:
            return None
        return cls(model_dir, hf_config, media)

    def place(
        self,
        ids: Sequence[int],
        sources: Sequence[Any],
        field: str = FIELD,
        fields: Sequence[str] | None = None,
    ) -> tuple[list[int], list[PlacedImage]]:
        """The prompt's ids with each image's placeholder expanded, and the images placed
        there; InvalidArgument naming the field (an image's own: `fields[i]`) for a bad
        image or too many of them. A source may be an image already processed."""
        self.check_count(len(sources), field)
        fields = fields or [f"{field}.image[{i}]" for i in range(len(sources))]
        processed = [self.process(source, name) for source, name in zip(sources, fields)]
        lengths = [image.num_tokens for image in processed]
        expanded, offsets = expand_placeholders(ids, self.token_id, lengths, field)
        placed = [PlacedImage(offset, image.num_tokens, image.content_hash, image.grid_thw,
                              image.pixel_values)
                  for offset, image in zip(offsets, processed)]  # fmt: skip
        return expanded, placed

    def check_count(self, count: int, field: str) -> None:
        limit = self.media.limit_images
        if count > limit:
            raise InvalidArgument(field, f"{field}: {count} images, at most {limit} per "
                                  f"prompt (--limit-mm-per-prompt)")  # fmt: skip

    def process(self, source: Any, field: str,
                overrides: dict[str, Any] | None = None) -> ProcessedImage:  # fmt: skip
        """`overrides`: a request's `mm_processor_kwargs` (vLLM's), over the server's."""
        if isinstance(source, ProcessedImage):
            return source
        processor = self.processor
        if overrides:
            processor = processor.with_overrides(overrides, "mm_processor_kwargs")
        return process_image(self.load(source, field), processor, field=field)

    def load(self, source: Any, field: str) -> Any:
        """One image (a PIL image, bytes or a URL) under the server's media rules."""
        domains = self.media.allowed_media_domains
        remote = isinstance(source, str) and source.lower().startswith(("http:", "https:"))
        if remote and domains is not None and urlparse(source).hostname not in domains:
            raise InvalidArgument(field, f"{field}: {urlparse(source).hostname!r} is not in "
                                  f"--allowed-media-domains")  # fmt: skip
        local = self.media.allowed_local_media_path
        local = None if local is None else str(local)
        return load_image(source, field=field, allow_remote=domains is not None,
                          allowed_local_media_path=local)  # fmt: skip
