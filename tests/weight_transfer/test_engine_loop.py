"""A chunk of weights is received on a worker thread: while the engine waits for the
trainer's bytes it still answers health checks, stats, pause/resume and new requests, and
calls that touch the channel or the weights wait behind the receive, in order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from hotswap import AsyncLLM, SamplingParams
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from hotswap.weight_transfer.base import checked_items, metas_to_update_info
from tests.helpers.waiting import until
from tests.weight_transfer.conftest import free_port

T = TypeVar("T")
ENGINE = dict(dtype="float32", progress=False, weight_transfer_config={"backend": "gloo"})


@pytest.mark.parametrize("multiprocess", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engine_answers_while_a_chunk_waits_for_the_trainer(
    multiprocess: bool, v1_dir, v2_dir, v2_trainer
) -> None:
    async def scenario() -> None:
        llm = AsyncLLM(str(v1_dir), multiprocess=multiprocess, **ENGINE)
        try:
            await llm.is_paused()  # the engine is up (and the client knows its loop)
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            trainer = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init,
                info,
                InProcessWeightSyncClient(llm),
                ModuleSource(v2_trainer),
            )
            metas, tensors = checked_items(trainer.source)
            await llm.start_weight_update(True)
            update = asyncio.create_task(llm.update_weights(metas_to_update_info(metas)))
            await asyncio.sleep(0)  # the task sends the call (AsyncLLM sends, then awaits)
            # The engine takes calls in order: it answers these once it started the receive,
            # while the chunk waits (nothing has been sent yet).
            assert await _soon(llm.is_paused()) is False
            assert (await _soon(llm.get_stats()))["weight_round_open"] is True
            await _soon(llm.pause_generation("keep"))
            await _soon(llm.resume_generation())
            queued = asyncio.create_task(_first_output(llm))
            world = asyncio.create_task(llm.get_world_size())  # waits behind the receive
            # The world size is sent before the first stats call (tasks run in creation
            # order), so the engine has taken it in by any stats answer; once it holds the
            # request too, neither is answered, nor the request scheduled, while the chunk
            # waits.
            stats = await until(lambda: _holding_one(llm), "the engine holds the request")
            assert stats["num_running"] == 0
            assert not update.done() and not world.done() and not queued.done()
            sender = threading.Thread(target=trainer.channel.send, args=(tensors,))
            sender.start()
            assert await update == len(metas)
            assert await world == 1
            sender.join()
            await llm.finish_weight_update("v2")
            assert await queued  # ran once the round closed
            assert (await llm.get_weight_version())["label"] == "v2"
        finally:
            llm.shutdown()

    asyncio.run(scenario())


async def _soon(call: Awaitable[T]) -> T:
    """The call's answer; a TimeoutError (not a hung test) if it waits on the receive."""
    return await asyncio.wait_for(call, timeout=30)


async def _holding_one(llm: AsyncLLM) -> dict | None:
    """The engine's stats once it holds one request, else None."""
    stats = await _soon(llm.get_stats())
    return stats if stats["num_requests"] == 1 else None


async def _first_output(llm: AsyncLLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    async for out in llm.generate("queued during the receive", params, request_id="q"):
        if out.finished:
            return out.outputs[0].token_ids
    return []
