"""A request's images as the engine core keeps them (multimodal/placement.py), from the
front-end's `ImageMsg`s, checked against the model and the prompt."""

from __future__ import annotations

from typing import Any

import numpy as np

from hotswap.engine.messages import ImageMsg
from hotswap.errors import InvalidArgument
from hotswap.multimodal.placement import ImagePlacement, PlacedImage


class ImageModel:
    """What the core knows of a multimodal model's images: its placeholder token and its
    vision tower's merge size (None for a text-only model)."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        vision = hf_config.get("vision_config")
        self.image_token_id = hf_config.get("image_token_id") if vision else None
        self.merge_size = int(vision.get("spatial_merge_size", 2)) if vision else 0

    def placement(self, ids: list[int], images: list[ImageMsg] | None) -> ImagePlacement | None:
        """The request's images, or InvalidArgument naming `multi_modal_data`."""
        if not images:
            return None
        if self.image_token_id is None:
            raise InvalidArgument("multi_modal_data", "multi_modal_data: this model does not "
                                  "take images")  # fmt: skip
        placed = [self._placed(ids, i, msg) for i, msg in enumerate(images)]
        for before, after in zip(placed, placed[1:]):
            if after.offset < before.end:
                raise InvalidArgument("multi_modal_data", "multi_modal_data: image "
                                      "placeholders overlap or are out of order")  # fmt: skip
        return ImagePlacement.of(placed, len(ids), self.merge_size)

    def _placed(self, ids: list[int], index: int, msg: ImageMsg) -> PlacedImage:
        t, h, w = msg.grid_thw
        field = f"multi_modal_data.image[{index}]"
        merged = t * h * w // self.merge_size**2 if min(t, h, w) > 0 else 0
        if merged != msg.length or h % self.merge_size or w % self.merge_size:
            raise InvalidArgument(field, f"{field}: grid {list(msg.grid_thw)} does not give "
                                  f"{msg.length} tokens")  # fmt: skip
        if len(msg.pixels) != t * h * w * msg.patch_dim * 4:
            raise InvalidArgument(field, f"{field}: pixel data does not match its grid")
        span = ids[msg.offset : msg.offset + msg.length]
        if msg.offset < 0 or len(span) != msg.length or set(span) != {self.image_token_id}:
            where = f"[{msg.offset}, {msg.offset + msg.length})"
            raise InvalidArgument(field, f"{field}: tokens {where} are not its placeholders")
        pixels = np.frombuffer(msg.pixels, dtype=np.float32).reshape(t * h * w, msg.patch_dim)
        return PlacedImage(msg.offset, msg.length, msg.content_hash, (t, h, w), pixels)


def image_msgs(images: list[PlacedImage]) -> list[ImageMsg]:
    """The wire form of a front-end's placed images."""
    return [ImageMsg(i.offset, i.length, i.content_hash, i.grid_thw, i.pixel_values.shape[1],
                     np.ascontiguousarray(i.pixel_values, np.float32).tobytes())
            for i in images]  # fmt: skip
