"""Expert parallelism (`enable_expert_parallel=True` with two tensor-parallel ranks): each
rank holds half of every sparse layer's routed experts whole. Against one rank in float32:
the same greedy tokens, logprobs within 1e-5 and the same routed experts (Qwen3-MoE,
Qwen2-MoE's shared expert still split, Mixtral). A round updating some experts changes
only the rank holding them (double-buffered too); stacked tensors, a disk reload, m2n
pushes from sharded trainer ranks and sparse deltas (of stacked and per-expert tensors)
give every rank its fresh share; an expert count the ranks do not divide is refused
naming tensor_parallel_size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer import diff_patches
from tests.engine.test_tensor_parallel import assert_same, make, run
from tests.helpers.moe import stacked_experts
from tests.weight_transfer.test_bad_input import send

# Two-rank engines (a worker process each) and one-rank references: slow.
pytestmark = pytest.mark.slow


def expert_parallel(path: Path, **kw):  # noqa: ANN201
    return make(path, 2, enable_expert_parallel=True, **kw)


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def rank_checksums(llm) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """{rank ("tp0"): {parameter: checksum}} from vLLM's per-rank keys."""
    found: dict[str, dict[str, str]] = {}
    for key, value in llm.call("get_weight_checksums").items():
        parts = key.split(":")
        found.setdefault(parts[3], {})[parts[-1]] = value
    return found


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_expert_parallel_ranks_generate_and_route_what_one_does(
    tiny_model_factory,  # noqa: ANN001
    arch: str,
) -> None:
    path = tiny_model_factory(arch)
    single = run(make(path, 1, enable_return_routed_experts=True))
    llm = expert_parallel(path, enable_return_routed_experts=True)
    try:
        config = json.loads((path / "config.json").read_text())
        count = config.get("num_experts") or config["num_local_experts"]
        inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        experts = llm.engine.runner.model.sparse_blocks()[0].experts  # rank 0's
        assert experts.gate_up_proj.shape[:2] == (count // 2, 2 * inter)  # half, whole
        parallel = run(llm)
        assert_same(single, parallel)
        for one, two in zip(single, parallel, strict=True):
            np.testing.assert_array_equal(two.outputs[0].routed_experts,
                                          one.outputs[0].routed_experts)  # fmt: skip
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("expert", "double_buffer"), [(1, False), (5, True)])
def test_a_round_of_some_experts_changes_only_the_rank_holding_them(
    tiny_model_factory,  # noqa: ANN001
    expert: int,
    double_buffer: bool,
) -> None:
    """Double-buffered, rank 0 receives the round and forwards to the other ranks' shadows
    even the tensors of experts it does not hold."""
    v1, v2 = tiny_model_factory("qwen3_moe", seed=0), tiny_model_factory("qwen3_moe", seed=1)
    new = checkpoint(v2)
    # one expert of layer 0: rank 0 holds experts 0-3, rank 1 experts 4-7
    some = {k: v for k, v in new.items() if f".mlp.experts.{expert}." in k and "layers.0." in k}
    config = {"backend": "ipc", "double_buffer": double_buffer}
    llm = expert_parallel(v1, weight_transfer_config=config)
    try:
        fresh = rank_checksums(llm)
        send(llm, sorted(some.items()))
        after = rank_checksums(llm)
        changed = {rank: sorted(k for k in after[rank] if after[rank][k] != fresh[rank][k])
                   for rank in after}  # fmt: skip
        layer = "model.layers.0.mlp.experts"
        holder, other = ("tp0", "tp1") if expert < 4 else ("tp1", "tp0")
        assert changed == {holder: [f"{layer}.down_proj", f"{layer}.gate_up_proj"], other: []}
        # the same weights on one rank generate the same tokens
        mixed = {**checkpoint(v1), **some}
        reference = make(v1, 1, weight_transfer_config={"backend": "ipc"})
        send(reference, sorted(some.items()))
        assert_same(run(reference), run(llm))
        # stacked (transformers 5's names): each rank takes its range of experts
        send(llm, sorted(stacked_experts(checkpoint(v1)).items()))
        assert rank_checksums(llm) == fresh
        send(llm, sorted(stacked_experts(mixed).items()))
        assert rank_checksums(llm) == after
        llm.call("load_weights_from_disk", model_path=str(v1))
        assert rank_checksums(llm) == fresh
    finally:
        llm.shutdown()


def test_an_expert_count_the_ranks_do_not_divide_is_refused(tiny_model_factory) -> None:  # noqa: ANN001
    path = tiny_model_factory("qwen3_moe", num_experts=7)
    with pytest.raises(InvalidArgument, match="divide the model's num_experts") as refused:
        expert_parallel(path)
    assert refused.value.field == "tensor_parallel_size"


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-expert"])
def test_m2n_trainer_ranks_update_expert_parallel_ranks(tiny_model_factory, stacked) -> None:  # noqa: ANN001
    """Two trainer ranks (FSDP-style shards) into two EP ranks: each engine rank receives
    the slices of the experts it holds (a stacked tensor's rows, or whole per-expert
    tensors) and ends as a fresh EP engine of the same weights."""
    from tests.weight_transfer.test_m2n import push

    v1, v2 = tiny_model_factory("qwen3_moe", seed=0), tiny_model_factory("qwen3_moe", seed=1)
    new = stacked_experts(checkpoint(v2)) if stacked else checkpoint(v2)
    fresh = expert_parallel(v2)
    llm = expert_parallel(v1, weight_transfer_config={"backend": "m2n"})
    try:
        push(llm, new, 2, 2)
        assert llm.get_weight_info()["digest"] == fresh.get_weight_info()["digest"]
        assert_same(run(fresh), run(llm))
    finally:
        llm.shutdown()
        fresh.shutdown()


@pytest.mark.parametrize("double_buffer", [False, True])
def test_sparse_deltas_patch_the_rank_holding_each_expert(
    tiny_model_factory,  # noqa: ANN001
    tmp_path: Path,
    double_buffer: bool,
) -> None:
    """Sparse patches of stacked expert tensors (each rank takes the patch's elements in
    its rows of experts) and of per-expert tensors (the rank holding that expert only)
    give what a fresh expert-parallel engine of the patched checkpoint holds and the
    tokens one rank generates on it."""
    from tests.weight_transfer.test_sparse import trainer

    path = tiny_model_factory("qwen3_moe")  # layers 0 and 2 sparse; rank 0 experts 0-3
    before = checkpoint(path)
    after = {name: tensor.clone() for name, tensor in before.items()}
    layer0, layer2 = "model.layers.0.mlp.experts", "model.layers.2.mlp.experts"
    after[f"{layer0}.2.gate_proj.weight"][3, 1] += 1.0  # rank 0, stacked gate rows
    after[f"{layer0}.6.up_proj.weight"][10, 5] -= 0.5  # rank 1, stacked up rows
    after[f"{layer0}.5.down_proj.weight"][7, 20] += 1.0  # rank 1, stacked down_proj
    after[f"{layer2}.1.down_proj.weight"][4, 3] += 1.0  # rank 0, per-expert
    after[f"{layer2}.5.up_proj.weight"][1, 4] -= 0.5  # rank 1, per-expert
    stacked = [f"{layer0}.gate_up_proj", f"{layer0}.down_proj"]
    old, new = stacked_experts(before), stacked_experts(after)
    patches = diff_patches({n: old[n] for n in stacked}, {n: new[n] for n in stacked})
    per_expert = [f"{layer2}.1.down_proj.weight", f"{layer2}.5.up_proj.weight"]
    patches += diff_patches({n: before[n] for n in per_expert}, {n: after[n] for n in per_expert})
    assert sum(p.indices.numel() for p in patches) == 5
    patched = tmp_path / "patched"
    shutil.copytree(path, patched)
    save_file(after, str(patched / "model.safetensors"), metadata={"format": "pt"})
    config = {"backend": "sparse", "double_buffer": double_buffer}
    llm = expert_parallel(path, weight_transfer_config=config)
    fresh = expert_parallel(patched)
    try:
        start = rank_checksums(llm)
        trainer(llm).send_patches(patches, "patched")
        changed = {rank: sorted(k for k in sums if sums[k] != start[rank][k])
                   for rank, sums in rank_checksums(llm).items()}  # fmt: skip
        assert changed == {"tp0": [f"{layer0}.gate_up_proj", f"{layer2}.down_proj"],
                           "tp1": [f"{layer0}.down_proj", f"{layer0}.gate_up_proj",
                                   f"{layer2}.gate_up_proj"]}  # fmt: skip
        assert llm.get_weight_info()["digest"] == fresh.get_weight_info()["digest"]
        assert_same(run(make(patched, 1)), run(llm))
    finally:
        llm.shutdown()
        fresh.shutdown()
