"""One trainer, two `hotswap serve` processes: one `send_weights()` over a gloo group of
three updates both, and the commit is all or nothing — when one engine refuses a round,
the other one (which alone would have accepted it) keeps its previous weights too."""

from __future__ import annotations

import functools

import httpx
import pytest

from hotswap import LLM
from hotswap.rl import EngineGroup, EngineGroupError
from hotswap.weight_transfer import (
    CommittedWeights,
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    TensorSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import concurrent_servers
from tests.weight_transfer.conftest import free_port

# Several servers behind one group: slow.
pytestmark = pytest.mark.slow

ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control")
STRICT = '{"backend": "gloo", "require_complete": true}'
LENIENT = '{"backend": "gloo"}'


@pytest.fixture(scope="module")
def servers(v1_dir):  # noqa: ANN201
    strict = (v1_dir, *ARGS, "--weight-transfer-config", STRICT)
    lenient = (v1_dir, *ARGS, "--weight-transfer-config", LENIENT)
    with concurrent_servers(strict, lenient) as started:
        yield tuple(started)


@functools.cache  # a checkpoint's digest: one engine per checkpoint, not one per call
def digest(path) -> str:  # noqa: ANN001
    return LLM(str(path), dtype="float32", progress=False).get_weight_info()["digest"]


def trainer_engine(group: EngineGroup, source):  # noqa: ANN001, ANN201
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=1 + group.num_workers)
    return WeightTransferTrainerFactory.trainer_init(info, group, source)


def test_one_send_updates_every_engine(servers, v2_trainer, v2_dir) -> None:
    group = EngineGroup([HTTPWeightSyncClient(s.url) for s in servers])
    assert group.num_workers == 2
    before = [info["version"] for info in group.weight_infos()]
    committed = trainer_engine(group, ModuleSource(v2_trainer)).send_weights("step-1", digest=True)
    assert group.check_consistent() == {"weight_version": "step-1", "digest": digest(v2_dir)}
    # What the commit returned: every engine's own answer, and what they have in common.
    assert committed.engines == tuple(
        CommittedWeights(v + 1, "step-1", digest(v2_dir)) for v in before
    )
    assert (committed.label, committed.digest) == ("step-1", digest(v2_dir))
    assert committed.version == (before[0] + 1 if len(set(before)) == 1 else None)


def test_a_round_one_engine_refuses_is_committed_nowhere(servers, v2_trainer) -> None:
    group = EngineGroup([HTTPWeightSyncClient(s.url) for s in servers])
    before = group.weight_infos()
    norm = v2_trainer.model.norm.weight.detach() + 1.0
    partial = TensorSource([("model.norm.weight", norm)])  # the strict engine refuses this
    with pytest.raises(EngineGroupError, match=r"nothing was committed.*engine 0 .*missing"):
        trainer_engine(group, partial).send_weights("partial")
    assert group.weight_infos() == before  # the lenient engine did not commit either
    for server in servers:
        stats = httpx.get(f"{server.url}/metrics").text
        assert 'hotswap:weight_round_open{model_name="tiny"} 0.0' in stats
    # The group still works: a complete round goes through on both.
    trainer_engine(group, ModuleSource(v2_trainer)).send_weights("step-2")
    assert group.check_consistent()["weight_version"] == "step-2"


def test_world_size_must_cover_every_worker(servers, v2_trainer) -> None:
    group = EngineGroup([HTTPWeightSyncClient(s.url) for s in servers])
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)  # forgot one engine
    with pytest.raises(ValueError, match="the trainer's world_size must be 3"):
        WeightTransferTrainerFactory.trainer_init(info, group, ModuleSource(v2_trainer))
    with pytest.raises(ValueError, match="world_sizes: one positive integer per engine"):
        EngineGroup([HTTPWeightSyncClient(s.url) for s in servers], world_sizes=[1])


def test_prepare_refuses_what_finish_would(servers) -> None:
    strict = HTTPWeightSyncClient(servers[0].url)
    r = strict.http.post("/prepare_weight_update")
    assert r.status_code == 409 and "no round is open" in r.json()["error"]["message"]
    strict.start_weight_update()
    try:
        r = strict.http.post("/prepare_weight_update")
        assert r.status_code == 400 and "does not cover every weight" in r.text
    finally:
        strict.finish_weight_update(abort=True)
