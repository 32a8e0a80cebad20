"""Qwen vision-language models: a Qwen decoder reading images. A vision tower (vision.py,
vision_qwen3.py) turns each image's patches into embeddings that take the place of the
image's placeholder tokens in the prompt, and the decoder's rotary positions are
three-dimensional (M-RoPE): an image token's (time, row, column), a text token's its index
shifted past the images before it, the same on all three axes. Qwen3-VL also adds the
tower's intermediate features ("deepstack") to the image rows after its first layers.

The runner gives a step the positions as three rows (`ImageStep.rope_positions`) and the
image rows' embeddings; a step with none (a text-only request) reads `positions` as usual.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hotswap.model.attention import AttentionMetadata
from hotswap.model.layers import RopeTable, RotaryEmbedding
from hotswap.model.models.decoder import ImageEmbeds
from hotswap.model.models.qwen2 import Qwen2ForCausalLM
from hotswap.model.models.qwen3 import Qwen3ForCausalLM
from hotswap.model.models.vision import Qwen2_5VisionTower
from hotswap.model.models.vision_qwen3 import Qwen3VisionTower

# Checkpoint prefixes: transformers 5's module names (what a trainer's named_parameters()
# gives) -> the original checkpoints' (what the model's parameters are named after).
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@dataclass
class ImageStep:
    """A step's multimodal inputs: every row's rotary positions [3, rows], and the rows
    that are image tokens with their embeddings (from the vision tower; with deepstack
    features, those follow each row's embedding: [rows, hidden * (1 + layers)])."""

    rope_positions: torch.Tensor
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: frequency j rotates by the position on axis `axis[j]`. `section`: how many
    frequencies each of time, row and column takes: in three blocks, in order (Qwen2.5-VL),
    or `interleaved` (Qwen3-VL: t, h, w, t, h, w, ... while each axis has some left, then
    time). With the three positions equal it is plain RoPE, bit for bit."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any],
                 section: Sequence[int], interleaved: bool = False) -> None:  # fmt: skip
        super().__init__(head_dim, max_positions, rope)
        half = head_dim // 2
        if len(section) != 3 or sum(section) != half:
            raise ValueError(
                f"config.json: rope_parameters.mrope_section {list(section)} must be three "
                f"sizes summing to head_dim / 2 ({half})"
            )
        if interleaved:
            j = torch.arange(half)
            axis = torch.zeros(half, dtype=torch.long)
            axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
        else:
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))
        self.register_buffer("axis", axis, persistent=False)
        self.register_buffer("columns", torch.arange(half), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        rows = positions[self.axis].T  # [tokens, head_dim / 2]: each frequency's position
        cos = self.cos[rows, self.columns].repeat(1, 2)[:, None, :].to(dtype)
        sin = self.sin[rows, self.columns].repeat(1, 2)[:, None, :].to(dtype)
        return cos, sin


class VisionLanguage:
    """What a Qwen vision-language model adds to its decoder class (mixed in first)."""

    # Decode steps compile (their three axes agree: plain RoPE, runner.py); CUDA graphs
    # are not captured for them yet.
    compilable = True
    # The decoder splits across ranks as a text model's; the vision tower is whole on
    # every rank, each encoding the step's images itself (sharding.py, runner.py).
    multimodal = True
    tower_class: type[nn.Module] = Qwen2_5VisionTower
    interleaved_mrope = False

    @property
    def graphable(self) -> bool:
        return False

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, *args: Any,
                 **kwargs: Any) -> None:  # fmt: skip
        """The decoder class's arguments (LlamaForCausalLM's)."""
        rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
        section = rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        if rope.get("rope_type", rope.get("type")) == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text = {**hf_config, "rope_parameters": rope, "rope_scaling": None}
        super().__init__(text, dtype, *args, **kwargs)  # type: ignore[call-arg]
        spec = self.spec
        if section is None:
            raise ValueError("config.json: rope_parameters.mrope_section is missing")
        self.model.rotary = MRotaryEmbedding(spec.head_dim, spec.max_positions, spec.rope,
                                             section, self.interleaved_mrope)  # fmt: skip
        self.visual = self.tower_class(hf_config["vision_config"], dtype)
        self.merge_size = self.visual.spec.spatial_merge_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageStep | None = None,
    ) -> torch.Tensor:
        if images is None:
            return self.model(input_ids, positions, meta)
        embeds = None
        if images.image_rows is not None:
            embeds = ImageEmbeds.of(images.image_rows, images.image_embeds, self.spec.hidden_size)
        return self.model(input_ids, images.rope_positions, meta, embeds)

    def encode_images(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden] (Qwen3-VL: [tokens, hidden * (1 +
        deepstack layers)]), from its patches (all images' patches in one tensor)."""
        out = self.visual(pixel_values.to(self.visual.dtype), grids)
        if isinstance(out, tuple):  # (embeddings, deepstack features)
            out = torch.cat([out[0], *out[1]], dim=-1)
        sizes = [t * h * w // self.merge_size**2 for t, h, w in grids]
        return list(out.to(self.model.dtype).split(sizes))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        text: list[tuple[str, torch.Tensor]] = []
        vision: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = checkpoint_name(name)
            if name.startswith("visual."):
                vision.append((name[len("visual.") :], tensor))
            else:
                text.append((name, tensor))
        loaded = super().load_weights(text)  # type: ignore[misc]
        return loaded | {f"visual.{n}" for n in self.visual.load_weights(vision)}

    def _map_name(self, name: str) -> tuple[str, Any] | None:
        name = checkpoint_name(name)
        if name.startswith("visual."):  # the tower's parameters carry the checkpoint's names
            return name, None
        return super()._map_name(name)  # type: ignore[misc]

    def _list_expected_keys(self) -> set[str]:
        keys = {k for k in super()._list_expected_keys() if not k.startswith("visual.")}  # type: ignore[misc]
        return keys | {f"visual.{k}" for k in self.visual.expected_checkpoint_keys()}


class Qwen2_5_VLForConditionalGeneration(VisionLanguage, Qwen2ForCausalLM):
    """Qwen2.5-VL: the Qwen2 decoder, the windowed vision tower, M-RoPE in three blocks."""


class Qwen3VLForConditionalGeneration(VisionLanguage, Qwen3ForCausalLM):
    """Qwen3-VL: the Qwen3 decoder, its vision tower's deepstack features added after the
    first layers, interleaved M-RoPE."""

    interleaved_mrope = True
    tower_class = Qwen3VisionTower


def checkpoint_name(name: str) -> str:
    """A tensor's name as the original checkpoints spell it."""
    for new, old in _PREFIXES:
        if name.startswith(new):
            return old + name[len(new) :]
    return name
