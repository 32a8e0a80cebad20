"""Resharded rounds (m2n) from M trainer ranks (threads of this process, each with its own
shards) into an engine of N tensor-parallel ranks: 2->2, 2->1, 1->2, 4->2 each give
weights equal to a fresh N-rank engine loaded from the same checkpoint (digest) and the
same greedy continuation, each engine rank receiving only its slices' bytes; 2 -> 2 x 2
into two data-parallel cores of two ranks. A malformed declaration is refused naming the
shard and changes nothing; a rank dying mid-round stops the engine instead of serving
mixed weights."""

from __future__ import annotations

import asyncio
import datetime
import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.model.parallel import TensorParallelError
from hotswap.weight_transfer import InProcessWeightSyncClient, WeightTransferTrainerFactory
from hotswap.weight_transfer.m2n_trainer import M2NTrainerInitInfo, Shard, ShardedSource
from tests.helpers.waiting import until
from tests.weight_transfer.conftest import free_port

pytestmark = pytest.mark.slow  # engines with worker processes, trainer groups

GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def dirs(tiny_model_factory) -> tuple[Path, Path]:
    """Qwen3 with one key/value head (replicated on two engine ranks)."""
    return (tiny_model_factory("qwen3", seed=0, num_key_value_heads=1),
            tiny_model_factory("qwen3", seed=1, num_key_value_heads=1))  # fmt: skip


def engine(path: Path, tp: int, backend: str | None = "m2n", **kw) -> LLM:
    config = {"backend": backend} if backend else None
    return LLM(str(path), dtype="float32", progress=False, tensor_parallel_size=tp,
               weight_transfer_config=config, **kw)  # fmt: skip


def shards_of(tensors: dict[str, torch.Tensor], rank: int, ranks: int) -> list[Shard]:
    """FSDP-style: dim 0 split evenly where it divides, else whole on rank 0."""
    out = []
    for name, t in sorted(tensors.items()):
        if ranks > 1 and t.dim() and t.shape[0] % ranks == 0:
            n = t.shape[0] // ranks
            out.append(Shard(name, t[rank * n : (rank + 1) * n].clone(), tuple(t.shape), 0,
                             rank * n))  # fmt: skip
        else:
            out.append(Shard(name, t if rank == 0 else torch.empty(0), tuple(t.shape)))
    return out


def push(llm: LLM, tensors: dict[str, torch.Tensor], trainers: int, tp: int,
         shards=shards_of) -> list[int]:  # noqa: ANN001  # fmt: skip
    """One round from `trainers` threads; each rank's bytes sent."""
    store = dist.TCPStore("127.0.0.1", 0, trainers, is_master=True, wait_for_workers=False)
    port, sent, errors = free_port(), [0] * trainers, []

    def trainer(rank: int) -> None:
        try:
            group = None
            if trainers > 1:
                own = dist.TCPStore("127.0.0.1", store.port, trainers, is_master=False)
                group = dist.ProcessGroupGloo(own, rank, trainers, datetime.timedelta(seconds=60))
            info = M2NTrainerInitInfo(rank=rank, master_port=port, world_size=trainers + tp,
                                      num_trainer_ranks=trainers, trainer_group=group,
                                      timeout_s=60)  # fmt: skip
            client = InProcessWeightSyncClient(llm) if rank == 0 else None
            sender = WeightTransferTrainerFactory.trainer_init(
                info, client, ShardedSource(shards(tensors, rank, trainers))
            )
            sender.send_weights("pushed")
            sent[rank] = sender.bytes_sent
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(trainers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return sent


PROMPTS = ["hello world the", "the quick brown"]


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


@pytest.mark.parametrize("trainers,tp", [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_m_trainer_ranks_update_n_engine_ranks(dirs, trainers: int, tp: int) -> None:
    v1, v2 = dirs
    new = load_file(str(v2 / "model.safetensors"))
    fresh = engine(v2, tp, backend=None)
    llm = engine(v1, tp)
    assert llm.get_world_size() == tp  # before any init: what the trainer sizes its group by
    try:
        sent = push(llm, new, trainers, tp)
        assert llm.get_weight_info()["digest"] == fresh.get_weight_info()["digest"]
        assert tokens(llm) == tokens(fresh)
        assert llm.get_world_size() == tp  # every engine rank receives
        whole = sum(t.numel() * t.element_size() for t in new.values())
        rank0 = llm.engine.weight_sync.transfer.rank.bytes_received
        if tp == 2:  # its slices, plus the replicated norms and key/value head
            assert rank0 < 0.6 * whole
        assert sum(sent) >= whole  # each byte leaves some trainer rank at least once
    finally:
        llm.shutdown()
        fresh.shutdown()


def test_fp8_engine_ranks_quantize_the_slices_they_receive(dirs) -> None:
    """2 -> 2 into FP8 weights: each engine rank quantizes its slices at the commit and
    holds what a fresh FP8 engine of two ranks loads (16 x 16 blocks: whole on each rank)."""
    v1, v2 = dirs
    fp8 = {"quantization": "fp8", "hf_overrides": {"quantization_config": {
        "weight_block_size": [16, 16]}}}  # fmt: skip
    fresh = engine(v2, 2, backend=None, **fp8)
    llm = engine(v1, 2, **fp8)
    try:
        push(llm, load_file(str(v2 / "model.safetensors")), 2, 2)
        assert llm.get_weight_info()["digest"] == fresh.get_weight_info()["digest"]
        assert tokens(llm) == tokens(fresh)
    finally:
        llm.shutdown()
        fresh.shutdown()


def test_a_malformed_declaration_changes_nothing(dirs) -> None:
    v1, v2 = dirs
    new = load_file(str(v2 / "model.safetensors"))

    def overlapping(tensors, rank, ranks):  # noqa: ANN001, ANN202
        out = shards_of(tensors, rank, ranks)
        first = out[0]  # a 2-D tensor split on dim 0: rank 1 claims one row too early
        if rank == 1 and first.dim == 0:
            out[0] = Shard(first.name, first.tensor, first.shape, 0, first.offset - 1)
        return out

    llm = engine(v1, 2)
    try:
        before = llm.get_weight_info()
        with pytest.raises(InvalidArgument, match="overlaps") as refused:
            push(llm, new, 2, 2, overlapping)
        assert refused.value.field == "init_info.src_shards[0][1].offset"  # the trainer's check
        bad = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 2,
               "world_size": 4, "names": ["model.norm.weight"], "dtype_names": ["float32"],
               "shapes": [[64]], "src_shards": [[{"rank": 0, "dim": 0, "offset": 0, "length": 40},
                                                 {"rank": 1, "dim": 0, "offset": 32,
                                                  "length": 32}]]}  # fmt: skip
        with pytest.raises(InvalidArgument, match="overlaps") as refused:
            llm.init_weight_transfer_engine(init_info=bad)  # and the engine's, before joining
        assert refused.value.field == "init_info.src_shards[0][1].offset"
        bad["src_shards"], bad["shapes"] = [None], [[63]]
        with pytest.raises(InvalidArgument, match="the model's is") as refused:
            llm.init_weight_transfer_engine(init_info=bad)
        assert refused.value.field == "init_info.shapes[0]"
        assert llm.get_weight_info() == before
        push(llm, new, 2, 2)  # the engine and its ranks still take a good declaration
        assert llm.get_weight_info()["version"] == before["version"] + 1
    finally:
        llm.shutdown()


def test_a_rank_dying_mid_round_stops_the_engine(dirs) -> None:
    v1, v2 = dirs
    llm = engine(v1, 2)
    procs = [psutil.Process(w.proc.pid) for w in llm.engine.runner.workers.workers]
    original = llm.update_weights

    def dies_first(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        procs[0].kill()  # the worker rank dies as the round's bytes start to move
        procs[0].wait(10)
        return original(*args, **kwargs)

    llm.update_weights = dies_first  # type: ignore[method-assign]
    with pytest.raises((TensorParallelError, RuntimeError)):
        push(llm, load_file(str(v2 / "model.safetensors")), 1, 2)
    with pytest.raises(TensorParallelError):  # never serves the weights of one rank
        llm.generate(["hello"], GREEDY, use_tqdm=False)


def test_an_in_flight_round_is_received_by_every_rank_while_steps_run(dirs) -> None:
    """Rank 0's receive runs beside the engine loop, the workers' in their transfer
    threads beside their steps: the request streams across the push (join, round and
    commit) and its later tokens carry the new version, the commit landing between two
    steps on every rank."""
    v1, v2 = dirs
    new = load_file(str(v2 / "model.safetensors"))

    async def scenario() -> tuple[int, set[int]]:
        llm = AsyncLLM(str(v1), multiprocess=False, progress=False, dtype="float32",
                       tensor_parallel_size=2,
                       weight_transfer_config={"backend": "m2n", "in_flight": True})  # fmt: skip
        try:
            outs: list = []
            params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

            async def stream() -> None:
                async for out in llm.generate("hello world", params, request_id="a"):
                    outs.append(out)

            task = asyncio.ensure_future(stream())
            await until(lambda: len(outs) >= 5, "the request streams")
            before = len(outs)
            await asyncio.get_running_loop().run_in_executor(None, push, llm, new, 2, 2)
            during = len(outs) - before
            await task
            return during, set(outs[-1].outputs[0].token_versions)
        finally:
            llm.shutdown()

    during, versions = asyncio.run(scenario())
    assert during > 0 and versions == {0, 1}


def test_every_rank_of_every_data_parallel_core_receives_its_slices(dirs) -> None:
    """Two data-parallel cores of two tensor-parallel ranks each: core i's rank r is
    engine rank i * 2 + r of the group, so 2 trainer ranks update 4 engine ranks in one
    round; both cores then hold a fresh two-rank engine's weights (the merged digest is
    null if the cores disagree) and generate its tokens."""
    v1, v2 = dirs
    new = load_file(str(v2 / "model.safetensors"))
    fresh = engine(v2, 2, backend=None)
    want = fresh.get_weight_info()["digest"], tokens(fresh)
    fresh.shutdown()

    async def scenario() -> tuple[int, str, list[list[int]]]:
        llm = AsyncLLM(str(v1), multiprocess=True, data_parallel_size=2, tensor_parallel_size=2,
                       dtype="float32", progress=False,
                       weight_transfer_config={"backend": "m2n"})  # fmt: skip
        try:
            world = await llm.get_world_size()  # what the trainer sizes its group by
            await asyncio.to_thread(push, llm, new, 2, world)

            async def one(i: int, prompt: str) -> list[int]:
                outs = [o async for o in llm.generate(prompt, GREEDY, request_id=f"r{i}")]
                return outs[-1].outputs[0].token_ids

            # together: least loaded first, one request on each core
            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            assert all(count > 0 for count in llm.client.routed)
            return world, (await llm.get_weight_info())["digest"], list(got)
        finally:
            llm.shutdown()

    world, digest, got = asyncio.run(scenario())
    assert world == 4
    assert (digest, got) == want
