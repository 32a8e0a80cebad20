"""Packed weight copies (oneDNN layout, bf16 batches above the GEMV's 8 rows) are derived
data: after every way weights change, an engine answers exactly as a fresh engine started
on the new weights, never from a stale copy."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.model.packed import can_pack

# Engines in this process over packed weights, each test seconds: slow.
pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512)  # fmt: skip
PROMPTS = [[3 + i, 40 + 2 * i, 7, 99 - i, 12] * 3 for i in range(16)]  # 16 rows: packed
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine(model_dir, **kw) -> LLM:  # noqa: ANN001
    return LLM(str(model_dir), dtype="bfloat16", progress=False, **kw)


def tokens(llm: LLM) -> list[list[int]]:
    llm.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tiny_model_factory):  # noqa: ANN001, ANN201
    return tiny_model_factory("llama", 0, **SHAPE), tiny_model_factory("llama", 1, **SHAPE)


@pytest.fixture(scope="module")
def expected(models):  # noqa: ANN001, ANN201
    return [tokens(engine(m)) for m in models]


def packed_in_use(llm: LLM) -> bool:
    return any(holder.nbytes for holder in llm.engine.runner.packed)


needs_packing = pytest.mark.skipif(
    not can_pack(), reason="oneDNN packs bf16 weights only with AVX512 or AVX-NE-CONVERT"
)


def test_batches_run_on_every_cpu(models, expected) -> None:  # noqa: ANN001
    """Packing is on by default; a CPU whose oneDNN cannot pack bf16 (AVX2 only, e.g. AMD
    Zen 3) runs its batches on the plain weights instead of failing the first GEMM."""
    llm = engine(models[0])
    assert bool(llm.engine.runner.packed) == can_pack()
    assert tokens(llm) == expected[0]
    assert packed_in_use(llm) == can_pack()


@needs_packing
def test_prefill_and_batches_use_packed_copies(models, expected) -> None:  # noqa: ANN001
    llm = engine(models[0])
    assert llm.engine.runner.packed and packed_in_use(llm)  # packed at start, not in a step
    assert tokens(llm) == expected[0]
    assert packed_in_use(llm)
    plain = engine(models[0], prepack_weights=False)
    assert plain.engine.runner.packed == []
    assert tokens(plain) == expected[0]  # same GEMMs' results, only the layout differs


@needs_packing
def test_every_weight_change_repacks(models, expected) -> None:  # noqa: ANN001
    llm = engine(models[0], enable_sleep_mode=True)
    assert tokens(llm) == expected[0] and packed_in_use(llm)
    llm.load_weights_from_disk(str(models[1]))
    assert not packed_in_use(llm)
    assert tokens(llm) == expected[1]
    (path,) = models[0].glob("*.safetensors")
    llm.load_weights_inline(load_file(path))
    assert tokens(llm) == expected[0]
    llm.call("sleep", level=1)
    assert not packed_in_use(llm)  # their memory goes with the weights'
    llm.call("wake_up")
    assert tokens(llm) == expected[0]


@needs_packing
def test_a_weight_round_repacks(models, expected) -> None:  # noqa: ANN001
    from hotswap.weight_transfer import (
        DiskTrainerInitInfo,
        InProcessWeightSyncClient,
        TensorSource,
        WeightTransferTrainerFactory,
    )

    llm = engine(models[0], weight_transfer_config={"backend": "disk"})
    assert tokens(llm) == expected[0] and packed_in_use(llm)
    (path,) = models[1].glob("*.safetensors")
    sync = WeightTransferTrainerFactory.trainer_init(
        DiskTrainerInitInfo(directory=str(models[1].parent / "round")),
        client=InProcessWeightSyncClient(llm),
        source=TensorSource(list(load_file(path).items())),
    )  # fmt: skip
    sync.send_weights("b")
    assert tokens(llm) == expected[1]
    assert torch.equal(
        llm.engine.runner.model.model.layers[0].mlp.down_proj.weight,
        load_file(path)["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16),
    )


def test_amx_tiles_serve_up_to_their_row_limit_and_are_derived() -> None:
    """Where the AMX kernel is built, batches of up to TILES_MAX_ROWS rows read its tiles
    and larger ones oneDNN's copy; both copies go with `invalidate`, and a batch remakes
    only the one it reads."""
    from hotswap.model.kernels import CpuKernels
    from hotswap.model.packed import TILES_MAX_ROWS, PackedWeight, packed_copy

    kernels = CpuKernels.load(progress=False)
    if kernels is None or kernels.amx_linear is None or not can_pack():
        pytest.skip("no AMX kernel or oneDNN packing on this CPU")
    weight = torch.randn(96, 128).to(torch.bfloat16)
    holder = packed_copy(weight, kernels)
    tiles = kernels.amx_pack_weight(weight)
    small = torch.randn(TILES_MAX_ROWS, 128).to(torch.bfloat16)
    large = torch.randn(TILES_MAX_ROWS + 1, 128).to(torch.bfloat16)
    assert torch.equal(holder.linear(small, weight, None), kernels.amx_linear(small, tiles, None))
    onednn = PackedWeight()  # oneDNN's copy alone
    assert torch.equal(holder.linear(large, weight, None), onednn.linear(large, weight, None))
    holder.invalidate()
    assert holder.nbytes == 0
    holder.linear(small[:3], weight, None)
    assert holder.nbytes == weight.numel() * 2  # the tiles only: a permutation of the weight
