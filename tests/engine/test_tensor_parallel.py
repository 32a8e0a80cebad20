"""Tensor parallelism (`tensor_parallel_size=2`) against one rank, in float32: greedy tokens
equal and logprobs within 1e-5, with key/value heads split (Llama) and replicated (Qwen3
with one key/value head); chunked prefill, prefix-cache hits, prompt logprobs, pause keep
and abort, sleep and wake; a worker extension on every rank over its share; a rank that
dies stops the engine; what does not run tensor-parallel yet is refused naming its flag."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import psutil
import pytest

from hotswap import LLM, AsyncLLM, EngineDeadError, SamplingParams
from hotswap.engine_args import EngineArgs
from hotswap.errors import InvalidArgument
from hotswap.model.parallel import TensorParallelError
from tests.helpers.waiting import until

LONG_PROMPT = "the quick brown fox jumps over the lazy dog and " * 6  # ~100 tokens: chunked
PROMPTS = ["hello world the", "a b c d e f g", LONG_PROMPT]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=2, prompt_logprobs=2)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tiny_model_factory):  # noqa: ANN001, ANN201
    """Llama: 2 key/value heads, one per rank; Qwen3 with 1: on both ranks."""
    kv_heads = 2 if request.param == "llama" else 1
    return tiny_model_factory(request.param, num_key_value_heads=kv_heads)


def make(path, tp: int, **kw) -> LLM:  # noqa: ANN001
    kw = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 32, **kw}
    return LLM(str(path), tensor_parallel_size=tp, progress=False, **kw)


def run(llm: LLM, params: SamplingParams = GREEDY) -> list:  # noqa: ANN001
    return [out for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_same(single: list, parallel: list) -> None:
    for one, two in zip(single, parallel, strict=True):
        a, b = one.outputs[0], two.outputs[0]
        assert a.token_ids == b.token_ids
        for want, got in zip(a.logprobs, b.logprobs, strict=True):
            assert want.keys() == got.keys()
            for token in want:
                assert abs(want[token].logprob - got[token].logprob) < 1e-5
        if two.prompt_logprobs is None:
            continue
        for want, got in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert want.keys() == got.keys()
            assert max(abs(want[t].logprob - got[t].logprob) for t in want) < 1e-5


@pytest.mark.slow
def test_two_ranks_generate_what_one_does(model_dir) -> None:  # noqa: ANN001
    single = run(make(model_dir, 1))
    llm = make(model_dir, 2, enable_sleep_mode=True)
    try:
        first = run(llm)
        assert_same(single, first)
        # the prompts' blocks now come from the prefix cache (prompt logprobs bypass it)
        again = run(llm, replace(GREEDY, prompt_logprobs=None))
        assert again[2].num_cached_tokens >= 8 * (len(again[2].prompt_token_ids) // 8 - 1)
        assert_same(single, again)
        llm.call("sleep", level=1)  # every rank offloads its share, then takes it back
        llm.call("wake_up")
        assert_same(single, run(llm))
        llm.call("sleep", level=2)  # every rank drops its share: reloaded from disk
        llm.call("wake_up")
        llm.call("load_weights_from_disk", model_path=str(model_dir))
        assert_same(single, run(llm))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_pause_keep_and_abort_run_on_every_rank_of_every_core(tiny_model_factory) -> None:
    path = tiny_model_factory("qwen3", num_key_value_heads=1)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = make(path, 1).generate(["one two three"], params, use_tqdm=False)[0]

    async def scenario() -> None:
        # two data-parallel engine cores of two ranks each: four processes
        llm = AsyncLLM(str(path), multiprocess=True, progress=False, dtype="float32",
                       tensor_parallel_size=2, data_parallel_size=2, block_size=8)  # fmt: skip
        try:
            seen: list = []
            kept = asyncio.ensure_future(_collect(llm, "one two three", params, "kept", seen))
            await until(lambda: len(seen) >= 3, "the request streams")
            await llm.pause_generation(mode="keep", clear_cache=False)
            await llm.resume_generation()
            assert (await kept).outputs[0].token_ids == expected.outputs[0].token_ids
            seen.clear()
            aborted = asyncio.ensure_future(_collect(llm, "one two three", params, "gone", seen))
            await until(lambda: len(seen) >= 3, "the request streams")
            await llm.pause_generation(mode="abort")
            assert (await aborted).outputs[0].finish_reason == "abort"
            await llm.resume_generation()
            stats = await llm.get_stats()
            assert stats["num_free_blocks"] == stats["num_blocks"]
            assert await llm.get_world_size() == 2  # receivers of a broadcast: one per core
        finally:
            llm.shutdown()

    asyncio.run(scenario())


async def _collect(llm: AsyncLLM, prompt: str, params: SamplingParams, rid: str, seen: list):  # noqa: ANN202
    async for out in llm.generate(prompt, params, request_id=rid):
        seen.append(out)
    return seen[-1]


def _workers(core) -> list[psutil.Process]:  # noqa: ANN001
    """The worker processes of an engine core (rank 0 runs in it)."""
    return [psutil.Process(w.proc.pid) for w in core.runner.workers.workers]


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_engine(tiny_llama) -> None:
    llm = make(tiny_llama, 2)
    for worker in _workers(llm.engine):
        worker.kill()
        worker.wait(10)
    with pytest.raises(TensorParallelError, match="a rank died or hung"):
        llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(TensorParallelError):  # and every later call that reaches the ranks
        llm.call("load_weights_from_disk", model_path=str(tiny_llama))


@pytest.mark.slow
def test_a_served_engine_whose_rank_dies_reports_itself_dead(tiny_llama) -> None:
    async def scenario() -> None:
        llm = AsyncLLM(str(tiny_llama), multiprocess=False, progress=False,
                       tensor_parallel_size=2)  # fmt: skip
        try:
            _workers(llm.client.core)[0].kill()
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("hello", SamplingParams(max_tokens=4), "r"):
                    pass
        finally:
            llm.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_model_that_cannot_split_is_refused_and_leaves_no_worker(tiny_model_factory) -> None:
    """Three key/value heads: two ranks can neither split nor replicate them evenly."""
    path = tiny_model_factory("llama", hidden_size=96, num_attention_heads=6,
                              num_key_value_heads=3)  # fmt: skip
    refused_leaving_no_worker(path, "divide the model's num_key_value_heads")


def refused_leaving_no_worker(path, match: str) -> None:  # noqa: ANN001
    """Two ranks of the model in `path` are refused at start naming tensor_parallel_size
    (the message matching `match`), and no worker process outlives the refusal."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(InvalidArgument, match=match) as refused:
        make(path, 2)
    assert refused.value.field == "tensor_parallel_size"
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}
    assert after <= before


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"weight_transfer_config": {"backend": "m2n", "double_buffer": True}},
         "weight_transfer_config.double_buffer"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"distributed_executor_backend": "uni"}, "distributed_executor_backend"),
        ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend"),
    ],
)  # fmt: skip
def test_what_does_not_run_tensor_parallel_yet_is_refused(tiny_llama, kwargs, field) -> None:
    kwargs = {"tensor_parallel_size": 2, **kwargs}
    with pytest.raises(InvalidArgument) as refused:
        EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config()
    assert refused.value.field == field


@pytest.mark.slow
def test_a_worker_extension_runs_on_every_rank_over_its_share(tiny_model_factory) -> None:
    first, second = tiny_model_factory("llama"), tiny_model_factory("llama", seed=1)
    probe = {"worker_extension_cls": "tests.engine.tp_probe:ShardProbe"}
    single, llm = make(first, 1, **probe), make(first, 2, **probe)
    try:
        before = [out.outputs[0].token_ids for out in run(llm)]
        whole = single.collective_rpc("share")[0]["qkv_rows"]
        shares = llm.collective_rpc("share")  # one answer per rank, each over its share
        assert [share["rank"] for share in shares] == [0, 1]
        assert [share["qkv_rows"] for share in shares] == [whole // 2, whole // 2]
        with pytest.raises(InvalidArgument, match="not a method"):
            llm.collective_rpc("nope")
        with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: refused on rank 1"):
            llm.collective_rpc("fail_on", args=(1,))
        # each rank loads whole tensors with its own code and keeps its slices
        loaded = llm.collective_rpc("load_checkpoint", args=(str(second),))
        assert loaded[0] == loaded[1] == single.collective_rpc("load_checkpoint",
                                                               args=(str(second),))[0]  # fmt: skip
        after = run(llm)
        assert_same(run(single), after)
        assert [out.outputs[0].token_ids for out in after] != before
    finally:
        single.shutdown()
        llm.shutdown()


@pytest.mark.slow
def test_fp8_weights_split_over_two_ranks(model_dir) -> None:  # noqa: ANN001
    """Each rank quantizes its share of what it loads: with shares of whole blocks, two
    ranks hold the one rank's codes and generate what it does; a block the shares do not
    divide is refused naming it."""
    fp8 = {"quantization": "fp8", "hf_overrides": {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [16, 16]}}}  # fmt: skip
    single = run(make(model_dir, 1, **fp8))
    llm = make(model_dir, 2, **fp8)
    try:
        assert_same(single, run(llm))
    finally:
        llm.shutdown()
    coarse = {**fp8, "hf_overrides": {"quantization_config": {"weight_block_size": [64, 64]}}}
    with pytest.raises(InvalidArgument) as refused:
        make(model_dir, 2, **coarse)
    assert refused.value.field == "quantization_config.weight_block_size"
