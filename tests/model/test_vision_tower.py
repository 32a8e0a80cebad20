"""The Qwen2.5-VL vision tower against transformers' own, on a tiny random config."""

from __future__ import annotations

import pytest
import torch

from hotswap.errors import InvalidArgument
from hotswap.model.models.vision import Qwen2_5VisionTower, VisionSpec

hf_vl = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
hf_cfg = pytest.importorskip("transformers.models.qwen2_5_vl.configuration_qwen2_5_vl")

TINY = {
    "depth": 4,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "out_hidden_size": 48,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "fullatt_block_indexes": [1, 3],
    "hidden_act": "silu",
}
PATCH_DIM = 3 * 2 * 14 * 14


def _hf_model(window_size: int) -> torch.nn.Module:
    cfg = hf_cfg.Qwen2_5_VLVisionConfig(**TINY, window_size=window_size)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = hf_vl.Qwen2_5_VisionTransformerPretrainedModel(cfg).float().eval()
    with torch.no_grad():
        # Random everything, norms included (HF initialises them to ones), so that a
        # misplaced weight shows.
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _ours(hf: torch.nn.Module, window_size: int, dtype: torch.dtype) -> Qwen2_5VisionTower:
    tower = Qwen2_5VisionTower({**TINY, "window_size": window_size}, dtype)
    loaded = tower.load_weights(hf.state_dict().items())
    assert loaded == tower.expected_checkpoint_keys()
    return tower


def _hf_run(hf: torch.nn.Module, pixels: torch.Tensor, grids: list) -> torch.Tensor:
    with torch.no_grad():
        out = hf(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output  # the merged embeddings; last_hidden_state is pre-merger


def _pixels(grids: list, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Qwen2_5VisionTower]:
    hf = _hf_model(56)
    return hf, _ours(hf, 56, torch.float32)


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6)],  # one image, windows of 2x2 units padded at the right edge
        [(1, 4, 6), (1, 8, 8), (1, 10, 14)],  # several grids in one call
        [(1, 10, 6), (1, 6, 14)],  # padded windows at the bottom and the right edges
        [(2, 6, 10)],  # a two-frame video: windows and full attention per frame
    ],
)
def test_matches_hf(pair, grids) -> None:
    hf, tower = pair
    pixels = _pixels(grids)
    with torch.no_grad():
        ours = tower(pixels, grids)
    ref = _hf_run(hf, pixels, grids)
    units = sum(t * h * w for t, h, w in grids) // 4
    assert ours.shape == ref.shape == (units, 48)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_wider_window_matches_hf() -> None:
    # window_size 112: 4x4 units per window; a 10x14 grid has 5x7 units, so edge windows of
    # 1 row and of 3 columns.
    hf = _hf_model(112)
    tower = _ours(hf, 112, torch.float32)
    grids = [(1, 10, 14), (1, 16, 8), (1, 2, 2)]
    pixels = _pixels(grids, seed=2)
    with torch.no_grad():
        ours = tower(pixels, grids)
    torch.testing.assert_close(ours, _hf_run(hf, pixels, grids), atol=1e-5, rtol=1e-5)


def test_batch_equals_images_alone(pair) -> None:
    _, tower = pair
    grids = [(1, 4, 6), (1, 8, 8), (1, 10, 14)]
    pixels = _pixels(grids, seed=3)
    with torch.no_grad():
        batch = tower(pixels, grids)
        alone = []
        offset = 0
        for t, h, w in grids:
            alone.append(tower(pixels[offset : offset + t * h * w], [(t, h, w)]))
            offset += t * h * w
    torch.testing.assert_close(batch, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_bf16_close(pair) -> None:
    hf, ours32 = pair
    tower = _ours(hf, 56, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())
    grids = [(1, 8, 8), (1, 4, 6)]
    pixels = _pixels(grids, seed=4)
    with torch.no_grad():
        out = tower(pixels, grids)
        ref = ours32(pixels, grids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1 * ref.abs().max().item(), rtol=0.05)
    # Close on the whole, not just elementwise within a loose bound.
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    assert cos > 0.999


def test_parameters_and_buffers() -> None:
    tower = Qwen2_5VisionTower({**TINY, "window_size": 56}, torch.float32)
    params = dict(tower.named_parameters())
    assert params["patch_embed.proj.weight"].shape == (32, 3, 2, 14, 14)
    assert params["blocks.3.attn.qkv.weight"].shape == (96, 32)
    assert params["merger.mlp.0.weight"].shape == (128, 128)
    assert params["merger.mlp.2.bias"].shape == (48,)
    assert not any(p.requires_grad for p in params.values())
    assert set(tower.state_dict()) == set(params)  # the rotary buffer is not persistent
    assert len(params) == 1 + 4 * 12 + 5


def test_load_weights_refuses_bad_tensors() -> None:
    tower = Qwen2_5VisionTower({**TINY, "window_size": 56}, torch.float32)
    with pytest.raises(InvalidArgument, match="blocks.0.attn.qkv.weight") as e:
        tower.load_weights([("blocks.0.attn.qkv.weight", torch.zeros(32, 32))])
    assert e.value.field == "weights"
    with pytest.raises(InvalidArgument, match="blocks.9.norm1.weight"):
        tower.load_weights([("blocks.9.norm1.weight", torch.zeros(32))])
    with pytest.raises(InvalidArgument, match="visual.merger.ln_q.weight"):
        tower.load_weights([("visual.merger.ln_q.weight", torch.zeros(32))])
    assert tower.load_weights([("merger.ln_q.weight", torch.ones(32))]) == {"merger.ln_q.weight"}


def test_spec_from_hf() -> None:
    spec = VisionSpec.from_hf({"in_chans": 3, "depth": 2})
    assert spec.depth == 2 and spec.in_channels == 3
    assert spec.fullatt_block_indexes == (7, 15, 23, 31) and spec.window_size == 112
    assert spec.window_units == 4 and spec.head_dim == 224
    with pytest.raises(ValueError, match="vision_config.hidden_act"):
        VisionSpec.from_hf({"hidden_act": "gelu"})


def test_refuses_bad_input() -> None:
    tower = Qwen2_5VisionTower({**TINY, "window_size": 56}, torch.float32)
    with pytest.raises(InvalidArgument, match="multiples of 2"):
        tower(torch.zeros(15, PATCH_DIM), [(1, 3, 5)])
    with pytest.raises(InvalidArgument) as e:
        tower(torch.zeros(15, PATCH_DIM), [(1, 4, 4)])
    assert e.value.field == "pixel_values"
