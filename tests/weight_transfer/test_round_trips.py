"""Round trips through every backend into an engine in this process: after a sync the
engine's weights (digest) and greedy tokens equal a fresh engine loaded with the trainer's
checkpoint; rounds repeat; mixed dtypes, tensors larger than the buffer, empty sources."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer import (
    DiskTrainerInitInfo,
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    TensorSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port, trainer_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown", "Pause, swap the weights"]
# One gloo round trip is the quick check of the weight plane; the other backends and
# layouts, and the other engine tests here, are slow.
KINDS = ["gloo-packed"] + [
    pytest.param(kind, marks=pytest.mark.slow)
    for kind in ("gloo-unpacked", "gloo-small-buffers", "ipc", "ipc-packed", "disk")
]


def make_llm(path: Path, backend: str, **kw) -> LLM:
    config = {"backend": backend, **kw}
    return LLM(str(path), dtype="float32", progress=False, weight_transfer_config=config)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(v1_dir: Path, v2_dir: Path) -> dict[str, tuple[list[list[int]], str]]:
    out = {}
    for name, path in (("v1", v1_dir), ("v2", v2_dir)):
        llm = LLM(str(path), dtype="float32", progress=False)
        out[name] = (tokens(llm), llm.get_weight_info()["digest"])
    assert out["v1"][0] != out["v2"][0]
    return out


def trainer_info(kind: str, tmp_path: Path):  # noqa: ANN201
    return {
        "gloo-packed": lambda: GlooTrainerInitInfo(master_port=free_port(), world_size=2),
        "gloo-unpacked": lambda: GlooTrainerInitInfo(
            master_port=free_port(), world_size=2, packed=False
        ),
        "gloo-small-buffers": lambda: GlooTrainerInitInfo(
            master_port=free_port(),
            world_size=2,
            packed_buffer_size_bytes=4096,
            packed_num_buffers=3,
        ),  # fmt: skip
        "ipc": lambda: IPCTrainerInitInfo(),
        "ipc-packed": lambda: IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=8192),
        "disk": lambda: DiskTrainerInitInfo(directory=str(tmp_path / "sync")),
    }[kind]()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_and_repeat(
    kind: str, v1_dir, v1_trainer, v2_trainer, reference, tmp_path: Path
) -> None:
    info = trainer_info(kind, tmp_path)
    llm = make_llm(v1_dir, info.backend, require_complete=True)
    client = InProcessWeightSyncClient(llm)
    to_v2 = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v2_trainer))
    to_v2.send_weights("v2")
    assert tokens(llm) == reference["v2"][0]
    weights = llm.get_weight_info()
    assert (weights["version"], weights["label"], weights["digest"]) == (
        1,
        "v2",
        reference["v2"][1],
    )
    # A second trainer engine on the same channel kind sends V1 back: round two.
    back = WeightTransferTrainerFactory.trainer_init(
        trainer_info(kind, tmp_path), client, ModuleSource(v1_trainer)
    )
    back.send_weights()
    assert tokens(llm) == reference["v1"][0]
    weights = llm.get_weight_info()
    assert (weights["version"], weights["label"], weights["digest"]) == (
        2,
        "v2",
        reference["v1"][1],
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_bf16_trainer_into_fp32_engine(backend: str, v1_dir, v2_dir, tmp_path: Path) -> None:
    bf16 = trainer_model(v2_dir, torch.bfloat16)
    llm = make_llm(v1_dir, backend)
    engine = WeightTransferTrainerFactory.trainer_init(
        trainer_info("gloo-packed" if backend == "gloo" else "ipc", tmp_path),
        InProcessWeightSyncClient(llm),
        ModuleSource(bf16),
    )
    engine.send_weights("bf16")
    params = llm.engine.runner.model.parameter_index()
    sent = dict(bf16.named_parameters())
    assert torch.equal(params["model.norm.weight"], sent["model.norm.weight"].float())
    assert torch.equal(params["lm_head"], sent["lm_head.weight"].float())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gloo-packed", "gloo-unpacked", "ipc"])
def test_empty_and_partial_sources(kind: str, v1_dir, v2_trainer, reference, tmp_path) -> None:
    llm = make_llm(v1_dir, trainer_info(kind, tmp_path).backend)
    client = InProcessWeightSyncClient(llm)
    WeightTransferTrainerFactory.trainer_init(
        trainer_info(kind, tmp_path), client, TensorSource([])
    ).send_weights("empty")
    assert llm.get_weight_info() == {"version": 1, "label": "empty", "digest": reference["v1"][1]}
    norm = v2_trainer.model.norm.weight.detach()
    WeightTransferTrainerFactory.trainer_init(
        trainer_info(kind, tmp_path), client, TensorSource([("model.norm.weight", norm)])
    ).send_weights("norm-only")
    params = llm.engine.runner.model.parameter_index()
    assert torch.equal(params["model.norm.weight"], norm)
    assert llm.get_weight_info()["version"] == 2


@pytest.mark.slow
def test_engine_format_names_are_copied_directly(v1_dir, v2_dir, reference, tmp_path) -> None:
    source = LLM(str(v2_dir), dtype="float32", progress=False)
    engine_weights = {
        name: p.detach().clone() for name, p in source.engine.runner.model.named_parameters()
    }
    save_file(engine_weights, str(tmp_path / "model.safetensors"))
    llm = make_llm(v1_dir, "disk", require_complete=True)
    llm.start_weight_update(is_checkpoint_format=False)
    assert llm.update_weights({"model_path": str(tmp_path)}) == len(engine_weights)
    llm.finish_weight_update("engine-format")
    assert tokens(llm) == reference["v2"][0]
    assert llm.get_weight_info()["digest"] == reference["v2"][1]


class NoCallsClient:
    """A non-sending trainer rank must never talk to the engine."""

    def __getattr__(self, name: str):  # noqa: ANN204
        raise AssertionError(f"rank != 0 called {name}")


def test_non_zero_ranks_iterate_the_source_but_never_send(v2_trainer) -> None:
    iterated = []

    class CountingSource(ModuleSource):
        def __iter__(self):  # noqa: ANN204
            for item in super().__iter__():
                iterated.append(item[0])
                yield item

    for info in (
        GlooTrainerInitInfo(master_port=free_port(), world_size=2, rank=1),
        IPCTrainerInitInfo(rank=3),
    ):
        iterated.clear()
        engine = WeightTransferTrainerFactory.trainer_init(
            info, NoCallsClient(), CountingSource(v2_trainer)
        )
        engine.send_weights("ignored")
        assert iterated == [name for name, _ in v2_trainer.named_parameters()]
