"""A multimodal model's step inputs: each row's M-RoPE positions and the image rows'
embeddings, from the vision tower, cached by image content."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from hotswap.execution.step_inputs import ImageRows
from hotswap.model.models.qwen2_vl import ImageStep
from hotswap.multimodal.placement import PlacedImage

# Images whose embeddings are kept (least recently used first out). A request's image is
# read by every chunk of its prefill and again by a recompute (preemption, clear_cache),
# so an image is encoded once while its requests run, unless this many others came since.
ENCODER_CACHE_IMAGES = 256


class ImageInputs:
    """The runner's multimodal part. Cached embeddings are those of the weights loaded
    now: `clear` on every weight change (a recompute after a round re-encodes)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded_images = 0  # how many images the tower has encoded (tests, metrics)

    def clear(self) -> None:
        self.cache.clear()

    def step(self, plan: ImageRows) -> ImageStep:
        """The model's `images` argument for a step."""
        rope_positions = torch.from_numpy(plan.positions).to(self.device)
        if not plan.slices:
            return ImageStep(rope_positions)
        embeds = self._embeddings([image for _, image, _, _ in plan.slices])
        rows = [torch.arange(row, row + hi - lo) for row, _, lo, hi in plan.slices]
        values = [embeds[image.content_hash][lo:hi] for _, image, lo, hi in plan.slices]
        return ImageStep(rope_positions, torch.cat(rows).to(self.device), torch.cat(values))

    def _embeddings(self, images: list[PlacedImage]) -> dict[str, torch.Tensor]:
        """Each image's embeddings by content hash; the uncached ones encoded in one call
        of the tower (images of different sizes together)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, PlacedImage] = {}
        for image in images:
            key = image.content_hash
            if key in self.cache:
                self.cache.move_to_end(key)
                found[key] = self.cache[key]
            elif key not in found:
                missing[key] = image
        if missing:
            todo = list(missing.values())
            pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in todo]))
            pixels = pixels.to(self.device)
            encoded = self._encode(pixels, [i.grid_thw for i in todo])
            self.encoded_images += len(todo)
            for image, embeds in zip(todo, encoded):
                found[image.content_hash] = self.cache[image.content_hash] = embeds
        while len(self.cache) > ENCODER_CACHE_IMAGES:
            self.cache.popitem(last=False)
        return found

    def _encode(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """In batch-invariant mode one image at a time: an image's embeddings are then the
        same bits whichever images came with it (the tower's products batch patches)."""
        if not getattr(self.model, "batch_invariant", False):
            return self.model.encode_images(pixels, grids)
        sizes = [t * h * w for t, h, w in grids]
        return [self.model.encode_images(part, [grid])[0]
                for part, grid in zip(pixels.split(sizes), grids)]  # fmt: skip


def text_positions(plan: ImageRows, device: torch.device) -> torch.Tensor | None:
    """The step's positions as one row where every row's three axes agree and no row is an
    image token (decode steps): M-RoPE is then plain RoPE at those positions, and the step
    can run through the compiled decode graphs. None otherwise."""
    if plan.slices:
        return None
    rope = plan.positions
    if not (rope == rope[0]).all():
        return None
    return torch.from_numpy(np.ascontiguousarray(rope[0])).to(device)
