"""Double-buffered weights (`double_buffer: true`): rounds are written into a second copy
and the commit swaps the two. What the engine serves must be exactly what copying would
have given, for complete rounds, partial rounds after a swap (the other weights must
come from the live copy, not the stale shadow) and aborted rounds; a budget that cannot
hold the copy is refused unless the fallback to copying is allowed."""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM
from hotswap.errors import InvalidArgument
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    TensorSource,
    WeightTransferTrainerFactory,
)
from hotswap.weights import double_buffer

# Engines in this process, one or more per test: slow.
pytestmark = pytest.mark.slow

SWAP = {"backend": "ipc", "double_buffer": True}


def engine(path, config: dict | None = None) -> LLM:  # noqa: ANN001
    return LLM(str(path), dtype="float32", progress=False, weight_transfer_config=config or SWAP)


def send(llm: LLM, source, label: str) -> None:  # noqa: ANN001
    client = InProcessWeightSyncClient(llm)
    sync = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client, source)
    sync.send_weights(label)
    sync.shutdown()


def norm_of(trainer, shift: float) -> TensorSource:  # noqa: ANN001
    return TensorSource([("model.norm.weight", trainer.model.norm.weight.detach() + shift)])


def digest(llm: LLM) -> str:
    return llm.get_weight_info()["digest"]


def test_swapped_rounds_serve_what_copied_rounds_do(v1_dir, v2_trainer) -> None:
    swap, copy = engine(v1_dir), engine(v1_dir, {"backend": "ipc"})
    assert swap.call("get_stats")["weight_switch"] == "swap"
    assert copy.call("get_stats")["weight_switch"] == "copy"
    q_proj = v2_trainer.model.layers[0].self_attn.q_proj.weight.detach()
    rounds = [
        (ModuleSource(v2_trainer), "full"),
        (norm_of(v2_trainer, 1.0), "partial after a swap"),  # the rest: live, not shadow
        (norm_of(v2_trainer, 2.0), "partial again"),
        # One shard of the fused qkv tensor: its k and v rows must stay as they are live.
        (TensorSource([("model.layers.0.self_attn.q_proj.weight", q_proj + 1.0)]), "shard"),
        (TensorSource([("model.layers.0.self_attn.q_proj.weight", q_proj - 1.0)]), "shard 2"),
        (ModuleSource(v2_trainer), "full again"),
    ]
    for source, label in rounds:
        send(swap, source, label)
        send(copy, source, label)
        assert digest(swap) == digest(copy), label
    assert swap.get_weight_info()["label"] == "full again"


def test_the_switch_is_a_pointer_swap(v1_dir, v2_trainer) -> None:
    llm = engine(v1_dir)
    model = llm.engine.runner.model
    live = {n: p.data_ptr() for n, p in model.named_parameters()}
    send(llm, ModuleSource(v2_trainer), "v2")
    after = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert all(after[n] != live[n] for n in live)  # every tensor now reads the other copy
    send(llm, ModuleSource(v2_trainer), "v2 again")
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == live  # and back


def abort_round(llm: LLM, source) -> None:  # noqa: ANN001
    """Send every tensor of `source` into a round (into the shadow), then abort it."""
    client = InProcessWeightSyncClient(llm)
    sync = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client, source)
    client.start_weight_update()
    sync.send_round(list(source.metadata()), [t for _, t in source])
    client.finish_weight_update(abort=True)
    sync.shutdown()


def test_an_aborted_round_leaves_the_live_weights_and_a_fresh_shadow(v1_dir, v2_trainer) -> None:
    swap, copy = engine(v1_dir), engine(v1_dir, {"backend": "ipc"})
    start = digest(swap)
    abort_round(swap, ModuleSource(v2_trainer))  # the whole round was in the shadow
    assert digest(swap) == start
    # The next partial round must not commit the aborted round's other weights.
    send(swap, norm_of(v2_trainer, 1.0), "partial")
    send(copy, norm_of(v2_trainer, 1.0), "partial")
    assert digest(swap) == digest(copy)


def test_a_budget_without_room_for_a_second_copy_is_refused(v1_dir, monkeypatch) -> None:
    monkeypatch.setattr(double_buffer, "available_bytes", lambda device: 1024)
    with pytest.raises(InvalidArgument, match=r"double_buffer: a second copy .* needs") as e:
        engine(v1_dir)
    assert e.value.field == "weight_transfer_config.double_buffer"
    llm = engine(v1_dir, {**SWAP, "allow_copy_fallback": True})
    assert llm.call("get_stats")["weight_switch"] == "copy"


def test_weights_in_another_dtype_are_cast_into_the_shadow(v1_dir, v2_dir) -> None:
    from transformers import AutoModelForCausalLM

    half = AutoModelForCausalLM.from_pretrained(v2_dir, dtype=torch.bfloat16)
    swap, copy = engine(v1_dir), engine(v1_dir, {"backend": "ipc"})
    send(swap, ModuleSource(half), "bf16")
    send(copy, ModuleSource(half), "bf16")
    assert digest(swap) == digest(copy)
