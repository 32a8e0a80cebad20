"""`send_weights()` returns what the engine committed, taken from the engine's answer to
the commit itself: version, label and (on request) the digest of the new weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hotswap import LLM, AsyncLLM
from hotswap.weight_transfer import (
    CommittedWeights,
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port


def digest_of(path: Path) -> str:
    return LLM(str(path), dtype="float32", progress=False).get_weight_info()["digest"]


def test_llm_rounds_return_version_label_and_digest(v1_dir, v1_trainer, v2_trainer, v2_dir):
    llm = LLM(str(v1_dir), dtype="float32", progress=False,
              weight_transfer_config={"backend": "ipc"})  # fmt: skip
    client = InProcessWeightSyncClient(llm)
    to_v2 = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), client, ModuleSource(v2_trainer)
    )
    assert to_v2.send_weights("step-1") == CommittedWeights(1, "step-1", None)
    committed = to_v2.send_weights("step-2", digest=True)
    assert committed == CommittedWeights(2, "step-2", digest_of(v2_dir))
    back = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), client, ModuleSource(v1_trainer)
    )
    # No label: the engine keeps its current one; the digest is the new weights'.
    assert back.send_weights(digest=True) == CommittedWeights(3, "step-2", digest_of(v1_dir))
    assert llm.get_weight_info() == {"version": 3, "label": "step-2", "digest": digest_of(v1_dir)}


def test_other_ranks_get_none(v1_dir, v2_trainer) -> None:
    llm = LLM(str(v1_dir), dtype="float32", progress=False,
              weight_transfer_config={"backend": "ipc"})  # fmt: skip
    info = IPCTrainerInitInfo(rank=1)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, InProcessWeightSyncClient(llm), ModuleSource(v2_trainer)
    )
    assert engine.send_weights("step-1") is None
    assert llm.get_weight_info()["version"] == 0  # rank 1 sends nothing


def test_async_llm_commit_answers_through_the_engine_loop(v1_dir, v2_trainer, v2_dir) -> None:
    """AsyncLLM: the answer crosses the engine-core loop (a thread here, the same code as
    the child process), gloo this time."""

    async def main() -> tuple[CommittedWeights | None, CommittedWeights | None, dict]:
        llm = AsyncLLM(str(v1_dir), dtype="float32", progress=False,
                       weight_transfer_config={"backend": "gloo"})  # fmt: skip
        try:
            await llm.get_weight_info()  # starts the engine
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            client = InProcessWeightSyncClient(llm)
            engine = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init, info, client, ModuleSource(v2_trainer)
            )
            first = await asyncio.to_thread(engine.send_weights, "a")
            second = await asyncio.to_thread(lambda: engine.send_weights("b", digest=True))
            engine.shutdown()
            return first, second, await llm.get_weight_info()
        finally:
            llm.shutdown()

    first, second, after = asyncio.run(main())
    assert first == CommittedWeights(1, "a", None)
    assert second == CommittedWeights(2, "b", digest_of(v2_dir))
    assert after == {"version": 2, "label": "b", "digest": second.digest}
