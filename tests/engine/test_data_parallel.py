"""Data parallel: two engine-core processes behind one AsyncLLM. Requests are spread over
both and produce what one engine produces; pause/resume and aborts reach every rank; one
gloo broadcast (trainer + 2 workers) updates both ranks."""

from __future__ import annotations

import asyncio

import pytest

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.engine.core_client import EngineCoreClient, OutputHandler
from hotswap.engine.dp_client import DPEngineClient, RankLauncher
from hotswap.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
)
from hotswap.engine_args import EngineArgs
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port, trainer_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [f"request {i} of a data-parallel batch" for i in range(6)]
ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)


def reference(path) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(path), progress=False, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


async def generate_all(llm: AsyncLLM) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        outs = [o async for o in llm.generate(PROMPTS[i], GREEDY, request_id=f"r{i}")]
        return outs[-1].outputs[0].token_ids

    return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


@pytest.mark.slow
def test_two_ranks_serve_control_and_sync_as_one(tiny_model_factory) -> None:
    v1, v2 = tiny_model_factory("llama", seed=0), tiny_model_factory("llama", seed=1)
    expected_v1, expected_v2 = reference(v1), reference(v2)

    async def scenario() -> None:
        config = {"backend": "gloo", "require_complete": True}
        llm = AsyncLLM(str(v1), multiprocess=True, data_parallel_size=2, progress=False,
                       weight_transfer_config=config, **ENGINE)  # fmt: skip
        try:
            assert await generate_all(llm) == expected_v1
            assert all(count > 0 for count in llm.client.routed)  # both ranks served
            assert await _unseeded_pair_differs(llm)
            await _abort_mid_flight(llm)
            assert not any(llm.client.active) and not llm.client.owner  # nothing leaked
            stats = await llm.get_stats()
            assert stats["data_parallel_size"] == 2 and stats["num_blocks"] == 128
            await llm.pause_generation("keep")
            assert await llm.is_paused()
            await llm.resume_generation()
            assert await llm.get_world_size() == 2
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=3)
            trainer = trainer_model(v2)
            sync = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init,
                info, InProcessWeightSyncClient(llm), ModuleSource(trainer),
            )  # fmt: skip
            committed = await asyncio.to_thread(lambda: sync.send_weights("v2", digest=True))
            assert await generate_all(llm) == expected_v2  # every rank has V2
            assert (await llm.get_weight_version())["label"] == "v2"
            v2_digest = LLM(str(v2), progress=False, **ENGINE).get_weight_info()["digest"]
            assert (await llm.get_weight_info())["digest"] == v2_digest  # ranks agree
            assert (committed.label, committed.digest) == ("v2", v2_digest)  # both ranks'
        finally:
            llm.shutdown()

    asyncio.run(scenario())


async def _unseeded_pair_differs(llm: AsyncLLM) -> bool:
    """Two unseeded samples of one prompt, on the two ranks: each rank draws its own
    noise (with one shared seed they were identical)."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    async def sample(request_id: str) -> list[int]:
        outs = [o async for o in llm.generate(PROMPTS[0], params, request_id=request_id)]
        return outs[-1].outputs[0].token_ids

    first, second = await asyncio.gather(sample("s0"), sample("s1"))
    return first != second


async def _abort_mid_flight(llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = llm.generate(PROMPTS[1], params, request_id="long")
    await anext(stream)
    assert await llm.abort("long") == 1
    outs = [o async for o in stream]
    assert outs[-1].outputs[0].finish_reason == "abort"
    await asyncio.sleep(0.2)  # the rank's abort output reaches the bookkeeping


def test_data_parallel_needs_processes(tiny_llama) -> None:
    with pytest.raises(ValueError, match="data_parallel_size: engine cores run in child"):
        AsyncLLM(str(tiny_llama), data_parallel_size=2, progress=False)
    with pytest.raises(ValueError, match="data_parallel_size: LLM runs one engine core"):
        LLM(str(tiny_llama), data_parallel_size=2, progress=False)
    with pytest.raises(ValueError, match="data_parallel_size"):
        AsyncLLM(str(tiny_llama), multiprocess=True, data_parallel_size=0, progress=False)


class _FakeRank(EngineCoreClient):
    """A rank whose abort answers at once, on the caller's thread: the fastest a real
    rank's receiver thread could deliver it."""

    def start(self, on_outputs: OutputHandler) -> None:
        self.on_outputs = on_outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        pass

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        aborted = [EngineCoreOutput(i, [], finish_reason="abort") for i in request_ids]
        self.on_outputs(EngineCoreOutputs(aborted))

    def call_utility(self, call: UtilityCall) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _FakeLauncher(RankLauncher):
    def start_rank(self, engine_args: EngineArgs, rank: int) -> EngineCoreClient:
        return _FakeRank()


def test_a_dead_rank_fails_the_survivors_requests_not_aborts_them() -> None:
    """Rank 1 dies while rank 0 holds a request: the front end gets the death first, and
    never a plain "abort" for rank 0's request (which would answer it 200, not 503)."""
    client = DPEngineClient(EngineArgs(model="unused", data_parallel_size=2), _FakeLauncher())
    delivered: list[EngineCoreOutputs] = []
    client.start(delivered.append)
    for i in range(2):  # least loaded first: one on each rank
        client.add_request(EngineCoreRequest(f"r{i}", [1, 2], SamplingParams()))
    assert client.owner == {"r0": 0, "r1": 1}
    client.ranks[1].on_outputs(EngineCoreOutputs(engine_error="process exited"))
    assert [batch.engine_error for batch in delivered] == ["rank 1: process exited"]
    assert not any(client.active) and not client.owner
    client.ranks[1].on_outputs(EngineCoreOutputs(engine_error="and again"))
    assert len(delivered) == 1  # the first death is the one reported
