"""Sleep levels, wake tags, reloading weights from disk, and resetting the prefix cache of
running requests — through AsyncLLM with the engine core on a thread (the process
transport is covered end to end by the HTTP tests)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from hotswap import AsyncLLM, SamplingParams
from hotswap.engine.errors import EngineStateError
from tests.helpers.waiting import until

PROMPT = "Reinforcement learning trains a policy while it keeps generating rollouts. " * 2
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def make_engine(tiny_llama):
    engines: list[AsyncLLM] = []

    def make(**kw) -> AsyncLLM:
        kw = {"dtype": "float32", "block_size": 8, "max_model_len": 256, **kw}
        kw.setdefault("enable_sleep_mode", True)
        engine = AsyncLLM(str(tiny_llama), progress=False, **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def core_of(llm: AsyncLLM):  # noqa: ANN201 - the in-process EngineCore
    return llm.client.core


async def holding(llm: AsyncLLM, count: int) -> bool:
    """Whether the engine holds `count` requests (admitted, not finished)."""
    return (await llm.get_stats())["num_requests"] == count


async def tokens_of(llm: AsyncLLM, prompt: str, request_id: str) -> list[int]:
    outs = [o async for o in llm.generate(prompt, PARAMS, request_id=request_id)]
    return outs[-1].outputs[0].token_ids


def test_sleep_needs_sleep_mode_and_valid_arguments(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine(enable_sleep_mode=False)
        with pytest.raises(EngineStateError, match="sleep mode is not enabled"):
            await llm.sleep(1)
        assert not await llm.is_sleeping() and not await llm.is_paused()
        llm = make_engine()
        for bad in (3, -1, True, "1"):
            with pytest.raises(ValueError, match="level"):
                await llm.sleep(bad)
        with pytest.raises(ValueError, match="mode"):
            await llm.sleep(1, "bogus")
        with pytest.raises(ValueError, match="tags"):
            await llm.wake_up(["gpu"])
        assert not await llm.is_sleeping() and not await llm.is_paused()

    asyncio.run(scenario())


def test_level1_keep_frees_kv_offloads_weights_and_resumes_exactly(make_engine) -> None:
    async def scenario() -> None:
        reference = make_engine(batch_invariant=True)
        expected = await tokens_of(reference, PROMPT, "ref")
        llm = make_engine(batch_invariant=True)
        digest = (await llm.get_weight_info())["digest"]
        outs = []

        async def consume() -> None:
            async for out in llm.generate(PROMPT, PARAMS, request_id="frozen"):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        while not outs or len(outs[-1].outputs[0].token_ids) < 10:
            await asyncio.sleep(0.001)
        await llm.sleep(1, "keep")
        core = core_of(llm)
        assert await llm.is_sleeping() and await llm.is_paused()
        assert all(p.numel() == 0 for p in core.runner.model.parameters())
        assert core.runner.kv_caches[0][0].numel() == 0
        assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_blocks
        assert (await llm.get_weight_info())["digest"] is None
        queued = asyncio.ensure_future(tokens_of(llm, PROMPT, "queued"))
        await until(lambda: holding(llm, 2), "the sleeping engine holds both requests")
        assert not task.done() and not queued.done()
        assert await llm.wake_up() == {
            "is_sleeping": False,
            "tags_woken": ["weights", "kv_cache", "scheduling"],
        }
        assert not await llm.is_paused()
        await asyncio.wait_for(asyncio.gather(task, queued), 30)
        assert outs[-1].outputs[0].token_ids == expected  # recomputed on the same weights
        assert queued.result() == expected
        assert (await llm.get_weight_info())["digest"] == digest

    asyncio.run(scenario())


def test_wake_tags_order_and_partial_wake(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine()
        await llm.sleep(1)
        with pytest.raises(EngineStateError, match="cannot wake scheduling"):
            await llm.wake_up(["scheduling"])
        assert await llm.is_sleeping()
        assert await llm.wake_up(["weights"]) == {"is_sleeping": True, "tags_woken": ["weights"]}
        assert core_of(llm).runner.kv_caches[0][0].numel() == 0
        woken = await llm.wake_up(["scheduling", "kv_cache"])
        assert woken == {"is_sleeping": False, "tags_woken": ["kv_cache", "scheduling"]}
        assert await tokens_of(llm, PROMPT, "after") != []

    asyncio.run(scenario())


def test_level0_pauses_only_and_a_prior_pause_survives_wake(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine()
        await llm.sleep(0)
        assert await llm.is_sleeping()
        assert core_of(llm).runner.residency.resident
        assert await llm.wake_up() == {"is_sleeping": False, "tags_woken": ["scheduling"]}
        assert not await llm.is_paused()
        await llm.pause_generation("keep")
        await llm.sleep(1)
        await llm.wake_up()
        assert await llm.is_paused()  # paused by the caller before sleeping: stays paused
        await llm.resume_generation()
        assert len(await tokens_of(llm, PROMPT, "runs")) == PARAMS.max_tokens

    asyncio.run(scenario())


def test_level2_discards_weights_until_loaded_from_disk(make_engine, tiny_llama) -> None:
    async def scenario() -> None:
        llm = make_engine()
        expected = await tokens_of(llm, PROMPT, "before")
        await llm.sleep(2)
        await llm.sleep(1)  # never loosens: still level 2
        assert (await llm.get_stats())["sleep_level"] == 2
        await llm.wake_up()
        stats = await llm.get_stats()
        assert stats["weights_missing"] and not stats["is_sleeping"]
        assert all(torch.count_nonzero(p) == 0 for p in core_of(llm).runner.model.parameters())
        queued = asyncio.ensure_future(tokens_of(llm, PROMPT, "queued"))
        await until(lambda: holding(llm, 1), "the engine holds the request")
        assert not queued.done()  # no step runs on discarded weights
        info = await llm.load_weights_from_disk(str(tiny_llama), "reloaded")
        assert info == {"version": 1, "label": "reloaded"}
        assert await asyncio.wait_for(queued, 30) == expected

    asyncio.run(scenario())


def test_a_wait_pause_that_could_never_end_is_refused(make_engine, tiny_llama) -> None:
    """After a level-2 sleep no step runs until weights are loaded, so a request frozen
    mid-generation could never finish: a `wait` pause is refused (409) and changes
    nothing, where it would hang; a `keep` pause is taken, and the request ends exactly
    once weights are back."""

    async def scenario() -> None:
        llm = make_engine()
        expected = await tokens_of(llm, PROMPT, "before")
        running = asyncio.ensure_future(tokens_of(llm, PROMPT, "frozen"))
        await until(lambda: core_of(llm).scheduler.has_started_requests(), "it started")
        await llm.sleep(2, mode="keep")
        await llm.wake_up()
        with pytest.raises(EngineStateError, match="mode: 'wait' would never return"):
            await asyncio.wait_for(llm.pause_generation(mode="wait"), 10)  # not a hang
        assert not await llm.is_paused()
        await llm.pause_generation(mode="keep")
        await llm.load_weights_from_disk(str(tiny_llama), "reloaded")
        await llm.resume_generation()
        assert await asyncio.wait_for(running, 30) == expected

    asyncio.run(scenario())


def test_bad_checkpoint_changes_nothing(make_engine, tiny_llama, tmp_path) -> None:
    async def scenario() -> None:
        llm = make_engine()
        before = await llm.get_weight_info()
        with pytest.raises(ValueError, match="model_path"):
            await llm.load_weights_from_disk(str(tmp_path / "nope"))
        # A checkpoint that lacks a tensor: refused after a partial copy, rolled back.
        broken = tmp_path / "broken"
        shutil.copytree(tiny_llama, broken)
        from safetensors.torch import load_file, save_file

        (path,) = broken.glob("*.safetensors")
        tensors = load_file(path)
        tensors = {k: v + 1 for k, v in tensors.items() if "layers.1.mlp" not in k}
        save_file(tensors, path)
        with pytest.raises(ValueError, match="missing weights"):
            await llm.load_weights_from_disk(str(broken))
        with pytest.raises(ValueError, match="weight_version"):
            await llm.load_weights_from_disk(str(tiny_llama), "")
        assert await llm.get_weight_info() == before

    asyncio.run(scenario())


def test_reset_prefix_cache_of_running_requests_keeps_outputs_exact(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine(batch_invariant=True)
        expected = await tokens_of(llm, PROMPT, "golden")
        task = asyncio.ensure_future(tokens_of(llm, PROMPT, "running"))
        await asyncio.sleep(0.05)
        await llm.reset_prefix_cache(reset_running_requests=True)
        assert await asyncio.wait_for(task, 30) == expected
        stats = await llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]

    asyncio.run(scenario())


def test_weights_cannot_start_changing_while_a_sleep_waits(make_engine) -> None:
    # A sleep in `wait` mode finishes when the running request does; a weight round
    # opened meanwhile would have its weights taken away mid-round.
    async def scenario() -> None:
        llm = make_engine(weight_transfer_config={"backend": "ipc"}, max_model_len=512)
        params = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)
        stream = llm.generate(PROMPT, params, request_id="long")
        await anext(stream)
        sleeping = asyncio.create_task(llm.sleep(1, "wait"))
        await asyncio.sleep(0)  # the task sends the call (AsyncLLM sends, then awaits)
        await llm.is_paused()  # answered in order: the engine has taken the sleep in
        assert not sleeping.done()
        with pytest.raises(EngineStateError, match="start_weight_update: a sleep is in progress"):
            await llm.start_weight_update()
        with pytest.raises(EngineStateError, match="a sleep is in progress"):
            await llm.load_weights_from_disk(str(core_of(llm).config.model.path))
        await llm.abort("long")  # the last running request ends: the sleep completes
        async for _ in stream:
            pass
        await sleeping
        await llm.wake_up()
        await llm.start_weight_update()  # allowed again once awake
        await llm.finish_weight_update(abort=True)

    asyncio.run(scenario())
