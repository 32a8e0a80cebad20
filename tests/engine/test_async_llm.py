"""AsyncLLM over the in-process engine core: streaming, pause modes, clear_cache,
weight-version provenance, the staleness bound, aborts and a pause/resume soak."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal

import pytest

from hotswap import AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams
from hotswap.engine.scheduler import PauseState
from hotswap.outputs import RequestOutput
from tests.helpers.waiting import until

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHARED = "Reinforcement learning trains a policy while it keeps generating rollouts. " * 3


# A child process per engine costs seconds: the process transport is slow.
@pytest.fixture(params=["inproc", pytest.param("process", marks=pytest.mark.slow)])
def transport(request) -> str:  # noqa: ANN001
    return request.param


@pytest.fixture
def make_engine(tiny_llama, transport: str):
    """Engines on the tested transport: a thread of this process, or a child process."""
    engines: list[AsyncLLM] = []

    def make(**kw) -> AsyncLLM:
        kw.setdefault("dtype", "float32")
        kw.setdefault("block_size", 8)
        kw.setdefault("max_model_len", 512)
        multiprocess = transport == "process"
        engine = AsyncLLM(str(tiny_llama), multiprocess=multiprocess, progress=False, **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


class Stream:
    """Consumes one request in the background, keeping every output it received."""

    def __init__(self, llm: AsyncLLM, prompt, params, request_id: str) -> None:  # noqa: ANN001
        self.outputs: list[RequestOutput] = []
        self.first = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(llm, prompt, params, request_id))

    async def _run(self, llm, prompt, params, request_id) -> RequestOutput:  # noqa: ANN001
        async for out in llm.generate(prompt, params, request_id=request_id):
            self.outputs.append(out)
            self.first.set()
        return self.outputs[-1]

    @property
    def done(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].outputs[0].finish_reason if self.outputs else None

    @property
    def num_tokens(self) -> int:
        return len(self.outputs[-1].outputs[0].token_ids) if self.outputs else 0


async def drain() -> None:
    """Let the event loop deliver what the engine already emitted."""
    for _ in range(5):
        await asyncio.sleep(0)


async def holding(llm: AsyncLLM, count: int) -> bool:
    """Whether the engine holds `count` requests (admitted, not finished)."""
    return (await llm.get_stats())["num_requests"] == count


async def assert_no_leak(llm: AsyncLLM) -> None:
    stats = await llm.get_stats()
    assert stats["num_requests"] == stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_mode_matrix(make_engine, mode: str) -> None:
    async def scenario() -> None:
        llm = make_engine()
        inflight = Stream(llm, "The quick", LONG, "inflight")
        await inflight.first.wait()
        await llm.pause_generation(mode=mode, clear_cache=False)
        await drain()
        assert await llm.is_paused()
        if mode == "abort":
            assert inflight.done and inflight.finish_reason == "abort"
            assert 0 < inflight.num_tokens < 400
        elif mode == "wait":
            assert inflight.done and inflight.finish_reason == "length"
            assert inflight.num_tokens == 400
        else:
            assert not inflight.done
            seen = len(inflight.outputs)
            await asyncio.sleep(0.2)
            assert len(inflight.outputs) == seen  # frozen: no token while paused
        queued = Stream(llm, "Pause", SamplingParams(temperature=0, max_tokens=20), "queued")
        held = 1 if mode == "keep" else 0  # the in-flight request, frozen
        await until(lambda: holding(llm, held + 1), "the paused engine holds the request")
        assert queued.outputs == []  # accepted, pending until resume
        await llm.resume_generation()
        await asyncio.wait_for(asyncio.gather(inflight.task, queued.task), 30)
        assert queued.finish_reason == "length" and queued.num_tokens == 20
        expected = {"abort": "abort", "wait": "length", "keep": "length"}[mode]
        assert inflight.finish_reason == expected
        if mode == "keep":
            assert inflight.num_tokens == 400
        await drain()
        await assert_no_leak(llm)

    asyncio.run(scenario())


def test_pause_resume_idempotent_and_invalid_mode_changes_nothing(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine()
        for mode in ["abort", "wait", "keep"] * 2:
            assert await llm.pause_generation(mode=mode) is None
            assert await llm.pause_generation(mode=mode) is None
            assert await llm.is_paused()
            with pytest.raises(ValueError, match="mode"):
                await llm.pause_generation(mode="bogus")
            assert await llm.is_paused()
            await llm.resume_generation()
            await llm.resume_generation()
            assert not await llm.is_paused()
            with pytest.raises(ValueError, match="mode"):
                await llm.pause_generation(mode="bogus")
            assert not await llm.is_paused()
        # A second pause never loosens: keep then wait stays PAUSED_ALL.
        await llm.pause_generation(mode="keep")
        await llm.pause_generation(mode="wait")
        assert (await llm.get_stats())["pause_state"] == PauseState.PAUSED_ALL.name
        await llm.resume_generation()

    asyncio.run(scenario())


def test_clear_cache_semantics_on_prefix_cache(make_engine) -> None:
    async def run(llm: AsyncLLM, request_id: str) -> RequestOutput:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = [
            out async for out in llm.generate(SHARED + "The quick", params, request_id=request_id)
        ]
        return outs[-1]

    async def scenario() -> None:
        llm = make_engine()
        golden = await run(llm, "golden")
        await llm.pause_generation(mode="wait", clear_cache=False)
        await llm.resume_generation()
        kept = await run(llm, "kept")
        await llm.pause_generation(mode="wait", clear_cache=True)
        await llm.resume_generation()
        cleared = await run(llm, "cleared")
        assert kept.outputs[0].token_ids == golden.outputs[0].token_ids
        assert cleared.outputs[0].token_ids == golden.outputs[0].token_ids
        assert kept.num_cached_tokens > 0 and cleared.num_cached_tokens == 0

    asyncio.run(scenario())


async def _keep_pause_run(llm: AsyncLLM, clear_cache: bool, label: str | None):  # noqa: ANN202
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    stream = Stream(llm, SHARED + "Paged", params, "frozen")
    while stream.num_tokens < 10:
        await asyncio.sleep(0.001)
    await llm.pause_generation(mode="keep", clear_cache=clear_cache)
    await drain()
    at_pause = stream.num_tokens
    if label is not None:
        await llm.update_weight_version(label)
    await llm.resume_generation()
    final = await asyncio.wait_for(stream.task, 30)
    return at_pause, final.outputs[0]


def test_keep_with_clear_cache_matches_uninterrupted_tokens(make_engine) -> None:
    async def scenario() -> None:
        reference = make_engine(batch_invariant=True)
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        out = [o async for o in reference.generate(SHARED + "Paged", params)][-1]
        llm = make_engine(batch_invariant=True)
        at_pause, choice = await _keep_pause_run(llm, clear_cache=True, label=None)
        assert 10 <= at_pause < 60
        assert choice.token_ids == out.outputs[0].token_ids

    asyncio.run(scenario())


@pytest.mark.parametrize("clear_cache", [True, False])
def test_version_spans_split_at_the_pause(make_engine, clear_cache: bool) -> None:
    async def scenario() -> None:
        llm = make_engine()
        at_pause, choice = await _keep_pause_run(llm, clear_cache=clear_cache, label="step-1")
        spans = [(s.version, s.label, s.start, s.end, s.stale) for s in choice.weight_versions]
        assert spans == [
            (0, "default", 0, at_pause, False),
            (1, "step-1", at_pause, 60, not clear_cache),
        ]
        assert await llm.get_weight_version() == {"version": 1, "label": "step-1"}

    asyncio.run(scenario())


def test_max_weight_lag_aborts_with_a_reason(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine()
        strict = Stream(llm, "The quick", SamplingParams(max_tokens=300, max_weight_lag=0), "s")
        loose = Stream(llm, "Pause", SamplingParams(max_tokens=300, max_weight_lag=1), "l")
        await strict.first.wait()
        await loose.first.wait()
        await llm.pause_generation(mode="keep")
        await llm.update_weight_version("v1")
        await drain()
        assert strict.done and strict.finish_reason == "abort"
        assert "max_weight_lag" in strict.outputs[-1].outputs[0].stop_reason
        assert not loose.done
        await llm.resume_generation()
        await asyncio.wait_for(loose.task, 30)
        assert loose.finish_reason in ("length", "stop")

    asyncio.run(scenario())


def test_abort_and_early_exit_free_the_kv(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine()
        victim = Stream(llm, "The quick", LONG, "victim")
        await victim.first.wait()
        await llm.abort("victim")
        await asyncio.wait_for(victim.task, 10)
        assert victim.finish_reason == "abort"
        async for out in llm.generate("Pause", LONG, request_id="quitter"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        await asyncio.sleep(0.1)
        await llm.pause_generation(mode="wait")  # round-trip: the abort has been applied
        await assert_no_leak(llm)

    asyncio.run(scenario())


def test_engine_death_fails_streams_and_calls(make_engine, transport: str) -> None:
    """The engine core dies mid-stream (a crashing step in-process; SIGKILL of the child
    process): the stream and later calls raise EngineDeadError promptly, nothing hangs."""

    async def scenario() -> None:
        llm = make_engine()
        stream = Stream(llm, "The quick", LONG, "doomed")
        await stream.first.wait()
        if transport == "process":
            await llm.pause_generation(mode="keep")
            os.kill(llm.client.process.pid, signal.SIGKILL)
        else:

            def broken_step() -> list:
                raise RuntimeError("simulated engine crash")

            llm.client.core.step = broken_step
        with pytest.raises(EngineDeadError, match="crash|exited"):
            await asyncio.wait_for(stream.task, 5)
        with pytest.raises(EngineDeadError):
            await llm.is_paused()

    asyncio.run(scenario())


@pytest.mark.slow
def test_soak_random_pause_resume_cycles(make_engine) -> None:
    """100 random pause/resume cycles (random modes and clear_cache) while 32 streams run,
    each finished stream replaced by a new one: every stream ends exactly once with a
    consistent finish reason and length, and the KV pool is whole again when idle. (100
    cycles run some 1300 streams, about 1000 of them ended by an abort-mode pause and 380
    to their length: each transition many times over.)"""

    async def scenario() -> None:
        llm = make_engine(num_kv_blocks=160, max_num_seqs=16)
        rng = random.Random(0)
        streams: list[tuple[Stream, int]] = []
        ids = itertools.count()

        def new_stream() -> tuple[Stream, int]:
            i, budget = next(ids), rng.randint(10, 80)
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=budget, ignore_eos=True)
            return Stream(llm, SHARED[: rng.randint(5, 200)], params, f"s{i}"), budget

        active = [new_stream() for _ in range(32)]
        streams.extend(active)
        for _ in range(100):
            await asyncio.sleep(rng.random() * 0.004)
            await llm.pause_generation(
                mode=rng.choice(["abort", "wait", "keep", "keep"]), clear_cache=rng.random() < 0.5
            )
            await asyncio.sleep(rng.random() * 0.002)
            await llm.resume_generation()
            for index, (stream, _) in enumerate(active):
                if stream.task.done():
                    active[index] = new_stream()
                    streams.append(active[index])
        await asyncio.wait_for(asyncio.gather(*(s.task for s, _ in streams)), 120)
        reasons = [s.finish_reason for s, _ in streams]
        assert reasons.count("abort") > 10 and reasons.count("length") > 10
        for stream, budget in streams:
            assert sum(o.finished for o in stream.outputs) == 1
            if stream.finish_reason == "length":
                assert stream.num_tokens == budget
            else:
                assert stream.finish_reason == "abort" and stream.num_tokens < budget
        await llm.pause_generation(mode="wait")
        await assert_no_leak(llm)

    asyncio.run(scenario())


def test_delta_outputs_concatenate_to_the_cumulative_result(make_engine) -> None:
    async def scenario() -> None:
        llm = make_engine()
        base = dict(temperature=0.0, max_tokens=24, ignore_eos=True, n=2, seed=1)
        cumulative = [o async for o in llm.generate("The quick", SamplingParams(**base))][-1]
        deltas = [
            o
            async for o in llm.generate(
                "The quick", SamplingParams(**base, output_kind=RequestOutputKind.DELTA)
            )
        ]
        for index in range(2):
            tokens = [t for d in deltas for c in d.outputs if c.index == index for t in c.token_ids]
            text = "".join(c.text for d in deltas for c in d.outputs if c.index == index)
            assert tokens == cumulative.outputs[index].token_ids
            assert text == cumulative.outputs[index].text
        assert deltas[-1].finished and sum(d.finished for d in deltas) == 1

    asyncio.run(scenario())


def test_shutdown_leaves_no_process_or_socket(make_engine, transport: str) -> None:
    async def scenario() -> None:
        llm = make_engine()
        [o async for o in llm.generate("Pause", SamplingParams(max_tokens=4))]
        llm.shutdown()
        if transport == "process":
            assert llm.client.process.poll() is not None
            assert not os.path.exists(llm.client.tmpdir)
        else:
            assert llm.client.thread is None
        with pytest.raises(EngineDeadError):
            await llm.is_paused()

    asyncio.run(scenario())


@pytest.mark.slow
def test_engine_process_exits_and_cleans_up_when_its_parent_is_killed(tiny_llama) -> None:
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = (
        "import sys, time\n"
        "from hotswap import AsyncLLM\n"
        f"llm = AsyncLLM({str(tiny_llama)!r}, multiprocess=True, progress=False)\n"
        "print(llm.client.process.pid, llm.client.tmpdir, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid, socket_dir = parent.stdout.readline().split()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(child_pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(int(child_pid), signal.SIGKILL)
        raise AssertionError("the engine process outlived its parent")
    assert not Path(socket_dir).exists()
