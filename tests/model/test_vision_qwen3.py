"""The Qwen3-VL vision tower against transformers' own, on a tiny random config."""

from __future__ import annotations

import pytest
import torch

from hotswap.errors import InvalidArgument
from hotswap.model.models.vision_qwen3 import Qwen3VisionSpec, Qwen3VisionTower

hf_vl = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
hf_cfg = pytest.importorskip("transformers.models.qwen3_vl.configuration_qwen3_vl")

TINY = {
    "depth": 4,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "out_hidden_size": 48,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "num_position_embeddings": 64,  # an 8x8 learned position grid
    "deepstack_visual_indexes": [1, 2],
}
PATCH_DIM = 3 * 2 * 16 * 16


def _hf_model() -> torch.nn.Module:
    cfg = hf_cfg.Qwen3VLVisionConfig(**TINY)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = hf_vl.Qwen3VLVisionModel(cfg).float().eval()
    with torch.no_grad():
        # Random everything, norms included (HF initialises them to ones and zeros), so that a
        # misplaced weight shows.
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _ours(hf: torch.nn.Module, dtype: torch.dtype) -> Qwen3VisionTower:
    tower = Qwen3VisionTower(dict(TINY), dtype)
    loaded = tower.load_weights(hf.state_dict().items())
    assert loaded == tower.expected_checkpoint_keys() == set(hf.state_dict())
    return tower


def _hf_run(hf: torch.nn.Module, pixels: torch.Tensor, grids: list) -> tuple:
    with torch.no_grad():
        out = hf(pixels, grid_thw=torch.tensor(grids))
    # pooler_output: the merged embeddings (last_hidden_state is pre-merger).
    return out.pooler_output, out.deepstack_features


def _pixels(grids: list, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g)


def _split(pixels: torch.Tensor, grids: list) -> list[torch.Tensor]:
    return list(pixels.split([t * h * w for t, h, w in grids]))


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Qwen3VisionTower]:
    hf = _hf_model()
    return hf, _ours(hf, torch.float32)


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 6)],  # one image, smaller than the 8x8 position grid
        # Several grids in one call: smaller, equal and larger than the position grid, one
        # non-square and one with a side of a single unit.
        [(1, 4, 6), (1, 8, 8), (1, 12, 18), (1, 2, 10)],
        [(2, 6, 10)],  # a two-frame video: attention per frame, same positions per frame
        [(1, 6, 4), (3, 4, 4), (1, 10, 6)],  # a three-frame video between images
    ],
)
def test_matches_hf(pair, grids) -> None:
    hf, tower = pair
    pixels = _pixels(grids)
    with torch.no_grad():
        ours, ours_ds = tower(pixels, grids)
    ref, ref_ds = _hf_run(hf, pixels, grids)
    units = sum(t * h * w for t, h, w in grids) // 4
    assert ours.shape == ref.shape == (units, 48)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert len(ours_ds) == len(ref_ds) == 2
    for a, b in zip(ours_ds, ref_ds):
        assert a.shape == b.shape == (units, 48)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_position_embedding_matters(pair) -> None:
    # The same pixels on a grid of another shape give other embeddings only through the
    # resampled position table and the rotary; zeroing the table changes the output.
    hf, _ = pair
    tower = _ours(hf, torch.float32)
    grids = [(1, 12, 18)]
    pixels = _pixels(grids, seed=5)
    with torch.no_grad():
        before, _ = tower(pixels, grids)
        tower.pos_embed.weight.zero_()
        after, _ = tower(pixels, grids)
    assert (before - after).abs().max() > 1e-2


def test_batch_equals_images_alone(pair) -> None:
    _, tower = pair
    grids = [(1, 4, 6), (2, 8, 8), (1, 12, 18)]
    pixels = _pixels(grids, seed=3)
    with torch.no_grad():
        batch, batch_ds = tower(pixels, grids)
        alone = [tower(p, [g]) for p, g in zip(_split(pixels, grids), grids)]
    torch.testing.assert_close(batch, torch.cat([a[0] for a in alone]), atol=1e-5, rtol=1e-5)
    for k, feats in enumerate(batch_ds):
        want = torch.cat([a[1][k] for a in alone])
        torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)


def test_bf16_close(pair) -> None:
    hf, ours32 = pair
    tower = _ours(hf, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())
    grids = [(1, 8, 8), (1, 4, 6)]
    pixels = _pixels(grids, seed=4)
    with torch.no_grad():
        out, ds = tower(pixels, grids)
        ref, ref_ds = ours32(pixels, grids)
    for a, b in [(out, ref), *zip(ds, ref_ds)]:
        assert a.dtype == torch.bfloat16
        cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.flatten(), dim=0)
        assert cos > 0.999


def test_empty_grids(pair) -> None:
    _, tower = pair
    out, ds = tower(torch.zeros(0, PATCH_DIM), [])
    assert out.shape == (0, 48) and len(ds) == 2 and all(d.shape == (0, 48) for d in ds)


def test_parameters() -> None:
    tower = Qwen3VisionTower(dict(TINY), torch.float32)
    params = dict(tower.named_parameters())
    assert params["patch_embed.proj.weight"].shape == (32, 3, 2, 16, 16)
    assert params["patch_embed.proj.bias"].shape == (32,)
    assert params["pos_embed.weight"].shape == (64, 32)
    assert params["blocks.3.attn.qkv.weight"].shape == (96, 32)
    assert params["blocks.0.norm1.bias"].shape == (32,)
    assert params["merger.norm.weight"].shape == (32,)  # per patch
    assert params["deepstack_merger_list.1.norm.weight"].shape == (128,)  # per unit
    assert params["deepstack_merger_list.0.linear_fc2.bias"].shape == (48,)
    assert not any(p.requires_grad for p in params.values())
    assert set(tower.state_dict()) == set(params)  # the rotary buffer is not persistent
    assert len(params) == 3 + 4 * 12 + 6 * 3
    assert tower.spec.spatial_merge_size == 2 and tower.dtype == torch.float32


def test_load_weights_refuses_bad_tensors() -> None:
    tower = Qwen3VisionTower(dict(TINY), torch.float32)
    with pytest.raises(InvalidArgument, match="blocks.0.attn.qkv.weight") as e:
        tower.load_weights([("blocks.0.attn.qkv.weight", torch.zeros(32, 32))])
    assert e.value.field == "weights"
    with pytest.raises(InvalidArgument, match="deepstack_merger_list.0.norm.weight"):
        tower.load_weights([("deepstack_merger_list.0.norm.weight", torch.zeros(32))])
    with pytest.raises(InvalidArgument, match="pos_embed.weight"):
        tower.load_weights([("pos_embed.weight", torch.zeros(2304, 32))])
    for name in (
        "blocks.9.norm1.weight",
        "deepstack_merger_list.2.norm.bias",
        "visual.merger.norm.weight",
    ):
        with pytest.raises(InvalidArgument, match=name) as e:
            tower.load_weights([(name, torch.zeros(32))])
        assert e.value.field == "weights"
    assert tower.load_weights([("merger.norm.weight", torch.ones(32))]) == {"merger.norm.weight"}


def test_spec_from_hf() -> None:
    spec = Qwen3VisionSpec.from_hf({"depth": 2, "deepstack_visual_indexes": [0]})
    assert spec.depth == 2 and spec.patch_size == 16 and spec.hidden_act == "gelu_pytorch_tanh"
    assert spec.num_position_embeddings == 2304 and spec.pos_grid_side == 48
    assert spec.deepstack_visual_indexes == (0,) and spec.head_dim == 72
    assert Qwen3VisionSpec.from_hf({}).deepstack_visual_indexes == (8, 16, 24)
    with pytest.raises(ValueError, match="vision_config.hidden_act"):
        Qwen3VisionSpec.from_hf({"hidden_act": "silu"})
    with pytest.raises(ValueError, match="vision_config.num_position_embeddings"):
        Qwen3VisionSpec.from_hf({"num_position_embeddings": 50})
    with pytest.raises(ValueError, match="vision_config.deepstack_visual_indexes"):
        Qwen3VisionSpec.from_hf({"depth": 4, "deepstack_visual_indexes": [1, 4]})


def test_refuses_bad_input() -> None:
    tower = Qwen3VisionTower(dict(TINY), torch.float32)
    with pytest.raises(InvalidArgument, match="multiples of 2") as e:
        tower(torch.zeros(15, PATCH_DIM), [(1, 3, 5)])
    assert e.value.field == "grid_thw"
    with pytest.raises(InvalidArgument) as e:
        tower(torch.zeros(15, PATCH_DIM), [(1, 4, 4)])
    assert e.value.field == "pixel_values"
