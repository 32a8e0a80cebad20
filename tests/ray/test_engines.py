"""Engine actors on a local Ray (2 CPUs, tiny models): they generate what an in-process
engine generates, stream, and take weights from one trainer through `RayEngineGroup` with
the two-phase commit — over the `ray` backend (object store) and over gloo."""

from __future__ import annotations

import concurrent.futures

import pytest

# Engine cores as Ray actors (a local Ray): slow.
pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from hotswap import LLM, SamplingParams  # noqa: E402
from hotswap.ray import RayEngineGroup, RayTrainerInitInfo, launch_engines  # noqa: E402
from hotswap.rl import EngineGroupError  # noqa: E402
from hotswap.weight_transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    ModuleSource,
    TensorSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port  # noqa: E402

PROMPTS = [[1, 5, 9, 14], [2, 3], [7, 7, 7, 7, 7, 7], [4, 100, 50]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Four engines fit on two CPUs: each takes half a CPU and one torch thread.
ENGINE = {"num_cpus_per_engine": 0.5}
ARGS = {"dtype": "float32", "num_threads": 1}


@pytest.fixture(scope="module")
def engines(local_ray, v1_dir):  # noqa: ANN001, ANN201
    launched = launch_engines(2, str(v1_dir), ARGS, **ENGINE)
    yield launched
    launched.shutdown()


def reference(path, prompts=PROMPTS) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(path), dtype="float32", progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def digest(path) -> str:  # noqa: ANN001
    return LLM(str(path), dtype="float32", progress=False).get_weight_info()["digest"]


def test_two_engine_actors_generate_what_one_in_process_engine_does(engines, v1_dir) -> None:
    group = RayEngineGroup(engines)
    outputs = group.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference(v1_dir)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    # Each engine ran its share (prompts are dealt out in turn).
    stats = ray.get([actor.front_end_stats.remote() for actor in engines])
    assert [s["prompt_tokens"] for s in stats] == [4 + 6, 2 + 3]
    assert group.names == engines.names


def test_an_actor_streams_and_a_cancelled_stream_frees_its_request(engines) -> None:
    actor = engines[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = [ray.get(ref) for ref in actor.generate_stream.remote([1, 2, 3], params)]
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 6 and len(outputs) > 1
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    # A long stream cancelled after its first output is aborted in the engine.
    long = SamplingParams(temperature=0.0, max_tokens=5000, ignore_eos=True)
    stream = actor.generate_stream.remote([1, 2, 3], long)
    ray.get(next(stream))
    ray.cancel(stream)
    for _ in range(100):
        stats = ray.get(actor.call.remote("get_stats"))
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        ray.get(actor.call.remote("is_paused"))  # a round trip, then look again
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_one_send_through_the_object_store_updates_every_actor(engines, v2_trainer,
                                                              v2_dir) -> None:  # fmt: skip
    group = RayEngineGroup(engines)
    before = [info["version"] for info in group.weight_infos()]
    # Small chunks: the round takes several objects, as a large model does.
    info = RayTrainerInitInfo(chunk_bytes=64 << 10)
    trainer = WeightTransferTrainerFactory.trainer_init(info, group, ModuleSource(v2_trainer))
    committed = trainer.send_weights("step-1", digest=True)
    assert (committed.label, committed.digest) == ("step-1", digest(v2_dir))
    assert [e.version for e in committed.engines] == [v + 1 for v in before]
    assert group.check_consistent() == {"weight_version": "step-1", "digest": digest(v2_dir)}
    outputs = group.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference(v2_dir)
    assert all(o.outputs[0].token_versions == [before[0] + 1] * 8 for o in outputs[:1])


@pytest.mark.slow
def test_a_gloo_round_one_actor_refuses_is_committed_by_none(local_ray, v1_dir,
                                                             v2_trainer) -> None:  # fmt: skip
    configs = [{"backend": "gloo", "require_complete": True}, {"backend": "gloo"}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two start side by side
        launches = [pool.submit(launch_engines, 1, str(v1_dir),
                                {**ARGS, "weight_transfer_config": config}, **ENGINE)
                    for config in configs]  # fmt: skip
    strict, lenient = (launch.result() for launch in launches)
    try:
        group = RayEngineGroup([strict[0], lenient[0]], names=strict.names + lenient.names)
        assert group.num_workers == 2
        before = group.weight_infos()
        norm = v2_trainer.model.norm.weight.detach() + 1.0
        partial = TensorSource([("model.norm.weight", norm)])
        info = GlooTrainerInitInfo(master_port=free_port(), world_size=3)
        trainer = WeightTransferTrainerFactory.trainer_init(info, group, partial)
        with pytest.raises(EngineGroupError, match=rf"nothing was committed.*{strict.names[0]}"):
            trainer.send_weights("partial")
        assert group.weight_infos() == before  # the lenient engine did not commit either
        trainer = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(master_port=free_port(), world_size=3), group,
            ModuleSource(v2_trainer),
        )  # fmt: skip
        trainer.send_weights("step-2")
        assert group.check_consistent()["weight_version"] == "step-2"
    finally:
        strict.shutdown()
        lenient.shutdown()
