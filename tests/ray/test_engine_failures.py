"""An engine actor killed in the middle of a round: the group raises naming it, the other
engine keeps its previous weights and keeps serving, and once Ray has restarted the dead
one, the next round brings both to the trainer's weights."""

from __future__ import annotations

import time

import pytest

# Engine cores as Ray actors (a local Ray): slow.
pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from hotswap import LLM, SamplingParams  # noqa: E402
from hotswap.ray import (  # noqa: E402
    EngineActorDiedError,
    RayEngineGroup,
    RayTrainerInitInfo,
    launch_engines,  # noqa: E402
)
from hotswap.rl import EngineGroupError  # noqa: E402
from hotswap.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class KillsMidRound(RayEngineGroup):
    """Kills engine 1 (Ray restarts it) as the round's second chunk goes out."""

    updates = 0

    def update_weights(self, update_info: dict) -> None:
        self.updates += 1
        if self.updates == 2:
            ray.kill(self.actors[1], no_restart=False)
        super().update_weights(update_info)


def wait_restarted(actor, timeout: float = 120.0) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(actor.ready.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.slow
def test_an_actor_killed_mid_round_aborts_it_everywhere_and_rejoins(
    local_ray, v1_dir, v2_dir, v2_trainer
) -> None:
    engines = launch_engines(2, str(v1_dir), {"dtype": "float32", "num_threads": 1},
                             num_cpus_per_engine=0.5, max_restarts=1)  # fmt: skip
    try:
        group = KillsMidRound(engines)
        before = group.clients[0].weight_info()
        info = RayTrainerInitInfo(chunk_bytes=64 << 10)
        trainer = WeightTransferTrainerFactory.trainer_init(info, group, ModuleSource(v2_trainer))
        with pytest.raises(EngineGroupError, match=rf"engine actor '{engines.names[1]}' died") as e:
            trainer.send_weights("step-1")
        assert isinstance(e.value.failed[1], EngineActorDiedError)
        assert e.value.failed[1].name == engines.names[1] and 0 not in e.value.failed
        # The survivor: its old weights, no round left open, and it serves.
        survivor = group.clients[0]
        assert survivor.weight_info() == before
        assert survivor.call("get_stats")["weight_round_open"] is False
        out = ray.get(engines[0].generate.remote([1, 2, 3], GREEDY))
        assert len(out.outputs[0].token_ids) == 6
        # Ray restarts engine 1 from the checkpoint; the next round reaches both.
        restarted = wait_restarted(engines[1])
        assert restarted["weights"]["digest"] == before["digest"]
        group = RayEngineGroup(engines)
        trainer = WeightTransferTrainerFactory.trainer_init(info, group, ModuleSource(v2_trainer))
        trainer.send_weights("step-2")
        v2 = LLM(str(v2_dir), dtype="float32", progress=False).get_weight_info()["digest"]
        assert group.check_consistent() == {"weight_version": "step-2", "digest": v2}
    finally:
        engines.shutdown()
