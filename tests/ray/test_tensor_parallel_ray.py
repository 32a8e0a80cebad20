"""Tensor parallelism on Ray: worker ranks as Ray actors (`distributed_executor_backend=
"ray"`), and `--data-parallel-backend ray` with one placement group per tensor-parallel
group (the core on bundle 0, its worker on bundle 1), as `launch_engines` gives each
engine. Greedy tokens in float32 equal one rank's; a worker actor that dies stops its
engine."""

from __future__ import annotations

import asyncio

import pytest

from hotswap import LLM, AsyncLLM, EngineDeadError, SamplingParams
from hotswap.errors import InvalidArgument
from tests.helpers.waiting import until, wait_until

ray = pytest.importorskip("ray")
from hotswap.ray import launch_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["hello world the", "a b c d e f g", "the quick brown fox jumps over the lazy dog"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ARGS = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 64, "progress": False}


@pytest.fixture(scope="module")
def one_rank(tiny_llama) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(tiny_llama), **ARGS)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def tp_actors() -> list[str]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if a["name"].startswith("hotswap-tp-rank-")]


def test_worker_ranks_as_actors_generate_what_one_rank_does(local_ray, tiny_llama, one_rank):  # noqa: ANN001
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray",
              num_threads=2, **ARGS)  # fmt: skip
    try:
        assert [name.split("-")[3] for name in tp_actors()] == ["1"]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == one_rank
    finally:
        llm.shutdown()
    wait_until(lambda: not tp_actors(), "the worker actor is gone")


def test_ray_data_parallel_places_each_core_with_its_worker(local_ray, tiny_llama, one_rank):  # noqa: ANN001
    async def scenario() -> None:
        llm = AsyncLLM(str(tiny_llama), data_parallel_backend="ray", tensor_parallel_size=2,
                       multiprocess=True, num_threads=2, **ARGS)  # fmt: skip
        try:
            table = ray.util.placement_group_table().values()
            groups = [g for g in table if g["name"].startswith("hotswap-tp-")
                      and g["state"] == "CREATED"]  # fmt: skip
            assert len(groups) == 1 and len(groups[0]["bundles"]) == 2
            # bundle 0 holds the core, bundle 1 its worker: neither CPU is free
            pg = groups[0]["placement_group_id"]
            free = ray.available_resources()
            assert free.get(f"CPU_group_0_{pg}", 0) == 0 and free.get(f"CPU_group_1_{pg}", 0) == 0
            got = [await _final(llm, prompt, f"r{i}") for i, prompt in enumerate(PROMPTS)]
            assert got == one_rank
            ray.kill(ray.get_actor(tp_actors()[0], namespace="hotswap-tests"), no_restart=True)
            with pytest.raises(EngineDeadError):
                await _final(llm, "hello", "after")
        finally:
            llm.shutdown()
        await until(lambda: not tp_actors(), "the worker actor is gone")

    asyncio.run(scenario())


def test_launched_engines_get_a_group_each_with_a_bundle_per_rank(local_ray, tiny_llama,
                                                                  one_rank):  # noqa: ANN001  # fmt: skip
    """launch_engines with tensor_parallel_size 2: each engine's own STRICT_PACK group of two
    half-CPU bundles, the engine actor on bundle 0 and its worker actor on bundle 1."""
    args = {k: v for k, v in ARGS.items() if k != "progress"}
    engines = launch_engines(2, str(tiny_llama), {**args, "tensor_parallel_size": 2},
                             num_cpus_per_engine=1)  # fmt: skip
    try:
        groups = engines.tensor_parallel_groups
        assert len(groups) == 2 and engines.placement_group is None
        free = ray.available_resources()
        for group in groups:
            assert group.bundle_specs == [{"CPU": 0.5}, {"CPU": 0.5}]
            held = [free.get(f"CPU_group_{i}_{group.id.hex()}", 0) for i in range(2)]
            assert held == [0, 0]  # engine and worker each on their bundle
        assert len(tp_actors()) == 2
        for engine in engines:
            outs = ray.get([engine.generate.remote(p, GREEDY) for p in PROMPTS])
            assert [o.outputs[0].token_ids for o in outs] == one_rank
    finally:
        engines.shutdown()
    wait_until(lambda: not tp_actors(), "the worker actors are gone")
    table = ray.util.placement_group_table()
    assert all(table[g.id.hex()]["state"] == "REMOVED" for g in groups)


@pytest.mark.parametrize(
    "args,placement,field",
    [({"tensor_parallel_size": 0}, "PACK", "tensor_parallel_size"),
     ({"tensor_parallel_size": "2"}, "PACK", "tensor_parallel_size"),
     ({"tensor_parallel_size": 2}, "SPREAD", "placement")],
)  # fmt: skip
def test_launch_engines_refuses_a_bad_tensor_parallel_layout(
    tiny_llama,
    args: dict,
    placement: str,
    field: str,  # noqa: ANN001
) -> None:
    """Refused before anything is placed or started (no Ray is needed to refuse)."""
    with pytest.raises(InvalidArgument) as refused:
        launch_engines(2, str(tiny_llama), args, placement=placement)
    assert refused.value.field == field


async def _final(llm: AsyncLLM, prompt: str, request_id: str) -> list[int]:
    final = None
    async for out in llm.generate(prompt, GREEDY, request_id=request_id):
        final = out
    assert final is not None
    return final.outputs[0].token_ids
