"""Placeholder expansion and M-RoPE positions, against transformers' `get_rope_index`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotswap.errors import InvalidArgument
from hotswap.multimodal.placement import (
    ImagePlacement,
    PlacedImage,
    expand_placeholders,
    mrope_positions,
)

PAD = 7


def _hf_positions(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 0, 1]}),
        vision_config=dict(depth=1, hidden_size=8, intermediate_size=8, num_heads=2,
                           out_hidden_size=8),
        image_token_id=PAD,
    )  # fmt: skip
    model = Qwen2_5_VLModel(config)
    tensor = torch.tensor([ids])
    positions, delta = model.get_rope_index(tensor, (tensor == PAD).int(), torch.tensor(grids))
    return positions[:, 0].numpy(), int(delta[0, 0])


@pytest.mark.parametrize(
    "layout",
    [
        [(3, (1, 4, 6)), (40, (1, 8, 8))],  # text, image, text, image, text
        [(0, (1, 2, 2))],  # the prompt opens with an image
        [(5, (1, 12, 4))],  # taller than wide
        [(2, (1, 4, 4)), (6, (1, 4, 4))],  # two images, text between
    ],
)
def test_positions_equal_transformers(layout: list) -> None:
    ids: list[int] = []
    placed = []
    for gap, grid in layout:
        ids += [1] * gap
        placed.append((len(ids), grid))
        ids += [PAD] * (grid[0] * grid[1] * grid[2] // 4)
    ids += [1] * 5
    ours, delta = mrope_positions(len(ids), placed, 2)
    theirs, their_delta = _hf_positions(ids, [g for _, g in layout])
    np.testing.assert_array_equal(ours, theirs)
    assert delta == their_delta


def test_positions_past_the_prompt_add_the_delta() -> None:
    image = PlacedImage(2, 4, "h", (1, 4, 4), np.zeros((16, 4), np.float32))
    placement = ImagePlacement.of([image], 8, 2)
    rows = placement.rope_positions(6, 11)
    np.testing.assert_array_equal(rows[:, :2], placement.prompt_positions[:, 6:8])
    assert (rows[:, 2:] == np.arange(8, 11) + placement.delta).all()
    assert placement.delta == 2 - 4  # a 2 x 2 image takes 4 tokens, 2 positions
    assert placement.keys(0, 2) == b"" and placement.keys(5, 8) == b"h"


def test_expand_once() -> None:
    ids = [1, PAD, 2, PAD, 3]
    out, offsets = expand_placeholders(ids, PAD, [3, 2], "f")
    assert out == [1, PAD, PAD, PAD, 2, PAD, PAD, 3] and offsets == [1, 5]
    again, offsets_again = expand_placeholders(out, PAD, [3, 2], "f")  # already expanded
    assert again == out and offsets_again == offsets


@pytest.mark.parametrize("ids,lengths", [([1, PAD, 2], [3, 3]), ([1, PAD, PAD, 2], [3]),
                                         ([1, 2], [1])])  # fmt: skip
def test_placeholders_that_do_not_match_are_refused(ids: list[int], lengths: list[int]) -> None:
    with pytest.raises(InvalidArgument) as e:
        expand_placeholders(ids, PAD, lengths, "multi_modal_data")
    assert e.value.field == "multi_modal_data"
