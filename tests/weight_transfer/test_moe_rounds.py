"""Weight rounds into a mixture-of-experts engine: per-expert tensors under their
checkpoint names, transformers 5's stacked tensors, some experts only, and sparse deltas
on expert tensors, all equal to an engine loaded from the same checkpoint (digest); a
wrong expert index or shape is refused naming the tensor and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM
from hotswap.weight_transfer import ModuleSource, TensorSource
from tests.weight_transfer.conftest import trainer_model
from tests.weight_transfer.test_bad_input import make_llm, send
from tests.weight_transfer.test_sparse import sparse_llm, trainer

# Engines in this process, two or three per test: slow.
pytestmark = pytest.mark.slow

EXPERT = "model.layers.0.mlp.experts.{}.{}.weight"


@pytest.fixture(scope="module")
def dirs(tiny_model_factory) -> tuple[Path, Path]:
    return tiny_model_factory("qwen3_moe", seed=0), tiny_model_factory("qwen3_moe", seed=1)


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def digest(path: Path) -> str:
    return LLM(str(path), dtype="float32", progress=False).get_weight_info()["digest"]


@pytest.mark.parametrize("backend", ["ipc", "gloo"])  # gloo: packed broadcast buffers
@pytest.mark.parametrize("form", ["per-expert names", "stacked (transformers 5)"])
def test_a_full_round_equals_the_checkpoint_it_came_from(dirs, form: str, backend: str) -> None:
    v1, v2 = dirs
    llm = make_llm(v1, backend)
    if form == "per-expert names":
        source = TensorSource(sorted(checkpoint(v2).items()))
    else:
        source = ModuleSource(trainer_model(v2))
        assert any(name.endswith("mlp.experts.gate_up_proj") for name, _ in source)
    send(llm, list(source), backend)
    assert llm.get_weight_info()["digest"] == digest(v2)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_a_round_may_update_some_experts_only(dirs, double_buffer: bool) -> None:
    v1, v2 = dirs
    llm = make_llm(v1, double_buffer=double_buffer)  # True: written into the shadow copy
    new = checkpoint(v2)
    sent = [EXPERT.format(3, proj) for proj in ("gate_proj", "up_proj", "down_proj")]
    send(llm, [(name, new[name]) for name in sent])
    model = llm.engine.runner.model
    expected = make_llm(v1).engine.runner.model
    expected.load_weights((name, new[name]) for name in sent)
    for (name, got), (_, want) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(got, want), name
    changed = model.model.layers[0].mlp.experts
    assert not torch.equal(changed.gate_up_proj[3], make_llm(v1).engine.runner.model
                           .model.layers[0].mlp.experts.gate_up_proj[3])  # fmt: skip


@pytest.mark.parametrize(
    "name,shape,message",
    [
        (EXPERT.format(8, "gate_proj"), (32, 64), "has 8 experts per layer"),
        (EXPERT.format(2, "down_proj"), (64, 31), "shape mismatch"),
        ("model.layers.0.mlp.experts.gate_up_proj", (9, 64, 64), "shape mismatch"),
        ("model.layers.1.mlp.experts.0.gate_proj.weight", (32, 64), "unknown parameter"),
    ],
)
def test_a_wrong_expert_or_shape_is_refused_naming_it(dirs, name, shape, message) -> None:
    llm = make_llm(dirs[0])
    before = llm.get_weight_info()
    good = checkpoint(dirs[1])[EXPERT.format(0, "up_proj")]
    with pytest.raises(ValueError, match=message) as refused:
        send(llm, [(EXPERT.format(0, "up_proj"), good), (name, torch.zeros(shape))])
    assert name in str(refused.value)
    assert llm.get_weight_info() == before  # the good tensor of the round was not applied


def test_sparse_deltas_patch_expert_tensors(dirs) -> None:
    v1, _ = dirs
    before = dict(ModuleSource(trainer_model(v1)))
    after = {name: t.clone() for name, t in before.items()}
    stacked = "model.layers.2.mlp.experts.down_proj"
    after[stacked][5, 7, 3] += 1.0
    after[stacked][0, 0, 0] -= 2.0
    from hotswap.weight_transfer import diff_patches

    llm = sparse_llm(v1)
    trainer(llm).send_patches(diff_patches(before, after), "patched")
    reference = sparse_llm(v1)
    reference.engine.runner.model.load_weights(after.items())
    assert llm.get_weight_info()["digest"] == reference.get_weight_info()["digest"]
    assert llm.get_weight_info()["digest"] != sparse_llm(v1).get_weight_info()["digest"]
