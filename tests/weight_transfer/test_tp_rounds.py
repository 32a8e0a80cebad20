"""Weight rounds into a tensor-parallel engine (two ranks): whole tensors from the trainer,
each rank keeping its slice, through ipc and a gloo broadcast, and sparse deltas; each
equal to a fresh two-rank engine loaded from the same weights (digest) and generating
what one rank does on them. A refused round changes no rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer import diff_patches
from hotswap.weight_transfer.base import ModuleSource
from tests.weight_transfer.conftest import trainer_model
from tests.weight_transfer.test_bad_input import send
from tests.weight_transfer.test_sparse import trainer

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


def engine(path: Path, tp: int = 2, backend: str = "ipc") -> LLM:
    return LLM(str(path), dtype="float32", progress=False, tensor_parallel_size=tp,
               weight_transfer_config={"backend": backend})  # fmt: skip


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


def test_sparse_deltas_land_in_the_slice_that_holds_them(dirs) -> None:
    before = dict(ModuleSource(trainer_model(dirs[0])))
    after = {name: t.clone() for name, t in before.items()}
    # one change in each rank's half of a column-parallel, a row-parallel and a vocab tensor
    after["model.layers.0.self_attn.q_proj.weight"][[3, 40], 5] += 1.0
    after["model.layers.1.mlp.down_proj.weight"][7, [2, 100]] -= 0.5
    after["lm_head.weight"][[1, 300], 0] += 2.0
    llm = LLM(str(dirs[0]), dtype="float32", progress=False, tensor_parallel_size=2,
              weight_transfer_config={"backend": "sparse"})  # fmt: skip
    expected = engine(dirs[0])
    try:
        trainer(llm).send_patches(diff_patches(before, after), "patched")
        expected.engine.runner.load_weights(after.items())
        assert llm.get_weight_info()["digest"] == expected.get_weight_info()["digest"]
        assert tokens(llm) == tokens(expected)
    finally:
        llm.shutdown()
        expected.shutdown()
