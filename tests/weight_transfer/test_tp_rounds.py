"""Weight rounds into a tensor-parallel engine (two ranks): whole tensors from the trainer,
each rank keeping its slice, through ipc and a gloo broadcast, and sparse deltas; each
equal to a fresh two-rank engine loaded from the same weights (digest) and generating
what one rank does on them; double-buffered rounds (every rank's shadow) equal copied
ones. A refused round changes no rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer import diff_patches
from hotswap.weight_transfer.base import ModuleSource, TensorSource
from tests.weight_transfer.conftest import trainer_model
from tests.weight_transfer.test_bad_input import send
from tests.weight_transfer.test_sparse import trainer
from tests.weights.test_double_buffer import abort_round, digest, norm_of
from tests.weights.test_double_buffer import send as send_source

# Two-rank engines (a worker process each) and their references: slow.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=10, temperature=0)
PROMPTS = ["hello world the", "the quick brown fox"]


@pytest.fixture(scope="module")
def dirs(tiny_model_factory) -> tuple[Path, Path]:
    """Qwen3 with one key/value head (replicated on both ranks) and q/k norms."""
    return (
        tiny_model_factory("qwen3", seed=0, num_key_value_heads=1),
        tiny_model_factory("qwen3", seed=1, num_key_value_heads=1),
    )


def engine(
    path: Path, tp: int = 2, backend: str = "ipc", double_buffer: bool = False, **kwargs
) -> LLM:  # noqa: ANN003
    return LLM(str(path), dtype="float32", progress=False, tensor_parallel_size=tp,
               weight_transfer_config={"backend": backend, "double_buffer": double_buffer},
               **kwargs)  # fmt: skip


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str, object]:  # noqa: ANN001
    """v2's digest on two ranks and its greedy tokens on one."""
    parallel = engine(dirs[1])
    try:
        return {
            "digest": parallel.get_weight_info()["digest"],
            "tokens": tokens(engine(dirs[1], 1)),
        }
    finally:
        parallel.shutdown()


@pytest.mark.parametrize("backend", ["ipc", "gloo"])
def test_whole_tensors_reach_every_rank_as_a_fresh_load(dirs, reference, backend: str) -> None:
    llm = engine(dirs[0], backend=backend)
    try:
        before = llm.get_weight_info()["digest"]
        send(llm, sorted(load_file(str(dirs[1] / "model.safetensors")).items()), backend)
        assert llm.get_weight_info()["digest"] == reference["digest"] != before
        assert tokens(llm) == reference["tokens"]
    finally:
        llm.shutdown()


def test_a_refused_round_changes_no_rank(dirs) -> None:
    llm = engine(dirs[0])
    try:
        before = llm.get_weight_info()
        good = load_file(str(dirs[1] / "model.safetensors"))
        wrong = [("model.norm.weight", good["model.norm.weight"]),
                 ("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64))]  # fmt: skip
        with pytest.raises(ValueError, match=r"k_proj.weight.*shape mismatch|shape mismatch"):
            send(llm, wrong)
        assert llm.get_weight_info() == before
        checksums = llm.call("get_weight_checksums")
        ranks = {key.split(":")[3] for key in checksums}
        assert ranks == {"tp0", "tp1"}  # vLLM's keys: each rank's share
    finally:
        llm.shutdown()


def test_double_buffered_rounds_serve_what_copied_rounds_do(dirs, reference) -> None:
    """Each rank writes its share into its own shadow; the commit swaps every rank between
    the same two steps. A full round, partial ones (a norm, one shard of the fused qkv,
    the key/value head both ranks hold), an aborted round and a partial one after it, one
    after a sleep: every rank's weights as copying gives them (digest), then v2's tokens
    on one rank."""
    swap = engine(dirs[0], double_buffer=True, enable_sleep_mode=True)
    copy = engine(dirs[0], enable_sleep_mode=True)
    try:
        assert swap.call("get_stats")["weight_switch"] == "swap"
        v2 = trainer_model(dirs[1])
        attention = v2.model.layers[0].self_attn
        rounds = [
            (ModuleSource(v2), "full"),
            (norm_of(v2, 1.0), "partial after a swap"),
            (TensorSource([("model.layers.0.self_attn.q_proj.weight",
                            attention.q_proj.weight.detach() + 1.0)]), "q shard"),
            (TensorSource([("model.layers.0.self_attn.k_proj.weight",
                            attention.k_proj.weight.detach() - 1.0)]), "replicated k"),
        ]  # fmt: skip
        for source, label in rounds:
            send_source(swap, source, label)
            send_source(copy, source, label)
            assert digest(swap) == digest(copy), label
        before = digest(swap)
        abort_round(swap, ModuleSource(trainer_model(dirs[0])))
        assert digest(swap) == before
        for llm in (swap, copy):  # must not commit the aborted round's other weights
            send_source(llm, norm_of(v2, 2.0), "partial after an abort")
        assert digest(swap) == digest(copy)
        for llm in (swap, copy):
            llm.call("sleep", level=1)  # every rank frees its shadow
            llm.call("wake_up")
            send_source(llm, norm_of(v2, 3.0), "partial after a sleep")
        assert digest(swap) == digest(copy)
        send_source(swap, ModuleSource(v2), "v2")
        assert digest(swap) == reference["digest"]
        assert tokens(swap) == reference["tokens"]
    finally:
        swap.shutdown()
        copy.shutdown()


@pytest.mark.parametrize("double_buffer", [False, True])
def test_sparse_deltas_land_in_the_slice_that_holds_them(dirs, double_buffer: bool) -> None:
    before = dict(ModuleSource(trainer_model(dirs[0])))
    after = {name: t.clone() for name, t in before.items()}
    # one change in each rank's half of a column-parallel, a row-parallel and a vocab tensor
    after["model.layers.0.self_attn.q_proj.weight"][[3, 40], 5] += 1.0
    after["model.layers.1.mlp.down_proj.weight"][7, [2, 100]] -= 0.5
    after["lm_head.weight"][[1, 300], 0] += 2.0
    llm = engine(dirs[0], backend="sparse", double_buffer=double_buffer)
    expected = engine(dirs[0])
    try:
        trainer(llm).send_patches(diff_patches(before, after), "patched")
        expected.engine.runner.load_weights(after.items())
        assert llm.get_weight_info()["digest"] == expected.get_weight_info()["digest"]
        assert tokens(llm) == tokens(expected)
    finally:
        llm.shutdown()
        expected.shutdown()
