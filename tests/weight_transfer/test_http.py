"""Weight sync against a real `hotswap serve` process: the trainer is this test process
(gloo over TCP, or shared memory), the routes answer with vLLM's bodies and status codes,
and a trainer killed mid-round leaves the server on its previous weights."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

from hotswap.weight_transfer import (
    CommittedWeights,
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightSyncError,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import RemoteServer, concurrent_servers
from tests.weight_transfer.conftest import free_port

# Servers and trainer processes: slow.
pytestmark = pytest.mark.slow

ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control")


def complete(server: RemoteServer) -> list[int]:
    body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def module_servers(v1_dir, v2_dir):
    """The gloo server the first tests sync into (V1), and a plain one on V2 (control on,
    no weight transfer configured) whose answers are what a sync to V2 must reproduce;
    nothing changes the plain one's weights. Started together."""
    gloo = (v1_dir, *ARGS, "--weight-transfer-config", '{"backend": "gloo"}')
    with concurrent_servers(gloo, (v2_dir, *ARGS)) as started:
        yield started


@pytest.fixture(scope="module")
def gloo_server(module_servers) -> RemoteServer:
    return module_servers[0]


@pytest.fixture(scope="module")
def v2_server(module_servers) -> RemoteServer:
    return module_servers[1]


def test_gloo_sync_over_http(gloo_server, v2_server, v1_trainer, v2_trainer) -> None:
    expected, expected_digest = complete(v2_server), reference_digest(v2_server)
    before = complete(gloo_server)
    client = HTTPWeightSyncClient(gloo_server.url)
    assert httpx.get(f"{gloo_server.url}/get_world_size").json() == {"world_size": 1}
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    engine = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v2_trainer))
    committed = engine.send_weights("step-1", digest=True)
    assert committed == CommittedWeights(1, "step-1", expected_digest)  # the commit's answer
    assert complete(gloo_server) == expected != before
    weights = client.weight_info()
    assert weights == {"weight_version": "step-1", "version": 1, "digest": expected_digest,
                       "weight_gen": 1, "weight_label": "step-1"}  # fmt: skip
    # Bodies and status codes of the routes themselves.
    http = httpx.Client(base_url=gloo_server.url, timeout=30)
    r = http.post("/update_weights", json={"update_info": {"names": [], "dtype_names": [],
                                                            "shapes": []}})  # fmt: skip
    assert r.status_code == 409 and "no round is open" in r.json()["error"]["message"]
    assert http.post("/start_weight_update").json() == {"message": "Weight update started"}
    r = http.post("/start_weight_update", json={"is_checkpoint_format": True})
    assert r.status_code == 409
    r = http.post("/finish_weight_update", json={"weight_version": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.weight_version"
    r = http.post("/finish_weight_update", json={"digest": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.digest"
    assert http.post("/finish_weight_update", json={"abort": True}).json() == {
        "message": "Weight update aborted"
    }
    # An update info the engine cannot size: a broadcast channel is then out of step with
    # its sender, so the round ends and the channel must be set up again.
    http.post("/start_weight_update")
    r = http.post("/update_weights", json={"update_info": {"names": ["a"]}})
    assert r.status_code == 400 and "dtype_names" in r.json()["error"]["message"]
    r = http.post("/start_weight_update")
    assert r.status_code == 409 and "init_weight_transfer_engine" in r.json()["error"]["message"]
    r = http.post("/init_weight_transfer_engine", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.init_info"
    assert client.weight_info() == weights
    # Round two, back to V1, on the same group.
    WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_port=free_port(), world_size=2), client,
        ModuleSource(v1_trainer),
    ).send_weights("step-2")  # fmt: skip
    assert complete(gloo_server) == before


def reference_digest(server: RemoteServer) -> str:
    return httpx.get(f"{server.url}/weight_info").json()["digest"]


KILLED_TRAINER = textwrap.dedent(
    """
    import os, sys, threading, time
    from transformers import AutoModelForCausalLM
    from hotswap.weight_transfer import (GlooTrainerInitInfo, HTTPWeightSyncClient,
        ModuleSource, WeightTransferTrainerFactory)
    from hotswap.weight_transfer.base import checked_items, metas_to_update_info
    url, port, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    client = HTTPWeightSyncClient(url)
    info = GlooTrainerInitInfo(master_port=port, world_size=2, timeout_s=30,
                               packed_buffer_size_bytes=4096)
    engine = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(model))
    metas, tensors = checked_items(engine.source)
    client.start_weight_update()
    threading.Thread(target=client.update_weights, args=(metas_to_update_info(metas),),
                     daemon=True).start()
    sends = iter(range(3))
    original = engine.channel._broadcast
    def dying(tensor):
        if next(sends, None) is None:
            print("dying mid-round", flush=True)
            os._exit(1)
        return original(tensor)
    engine.channel._broadcast = dying
    engine.channel.send(tensors)
    """
)


def test_trainer_killed_mid_round_keeps_previous_weights(gloo_server, v1_trainer, v2_dir):
    before_digest = reference_digest(gloo_server)
    before_tokens = complete(gloo_server)
    result = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, gloo_server.url, str(free_port()), str(v2_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "dying mid-round" in result.stdout, result.stderr
    deadline = time.monotonic() + 60
    closed = 'hotswap:weight_round_open{model_name="tiny"} 0.0'
    while closed not in httpx.get(f"{gloo_server.url}/metrics", timeout=60).text:
        assert time.monotonic() < deadline, "the engine never noticed the dead trainer"
        time.sleep(0.2)
    assert reference_digest(gloo_server) == before_digest
    assert complete(gloo_server) == before_tokens
    # The channel must be set up again; then a good round goes through.
    client = HTTPWeightSyncClient(gloo_server.url)
    with pytest.raises(WeightSyncError, match="init_weight_transfer_engine"):
        client.start_weight_update()
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v1_trainer)).send_weights()
    assert reference_digest(gloo_server) == before_digest  # V1 again, re-sent


def test_ipc_sync_over_http(v1_dir, v2_server, v2_trainer) -> None:
    config = '{"backend": "ipc", "require_complete": true}'
    expected = complete(v2_server)
    with RemoteServer(v1_dir, *ARGS, "--weight-transfer-config", config) as server:
        client = HTTPWeightSyncClient(server.url)
        info = IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=32 << 10)
        committed = WeightTransferTrainerFactory.trainer_init(
            info, client, ModuleSource(v2_trainer)
        ).send_weights("ipc")
        assert committed == CommittedWeights(1, "ipc", None)  # no digest unless asked for
        assert complete(server) == expected


def test_weight_routes_need_control_and_config(v1_dir, v2_server) -> None:
    r = httpx.post(f"{v2_server.url}/start_weight_update")  # control on, no config
    assert r.status_code == 409 and "not configured" in r.json()["error"]["message"]
    with RemoteServer(v1_dir, "--served-model-name", "tiny") as server:
        assert httpx.post(f"{server.url}/start_weight_update").status_code == 404


def test_sparse_and_disk_over_http(v1_dir, v1_trainer, tmp_path) -> None:
    from hotswap.weight_transfer import DiskTrainerInitInfo, SparsePatch, SparseTrainerInitInfo

    norm = v1_trainer.model.norm.weight.detach()
    specs = [(v1_dir, *ARGS, "--weight-transfer-config", f'{{"backend": "{backend}"}}')
             for backend in ("sparse", "disk")]  # fmt: skip
    with concurrent_servers(*specs) as (sparse, disk):
        before = reference_digest(sparse)
        client = HTTPWeightSyncClient(sparse.url)
        info = SparseTrainerInitInfo(master_port=free_port(), world_size=2)
        engine = WeightTransferTrainerFactory.trainer_init(info, client, None)
        patch = SparsePatch("model.norm.weight", tuple(norm.shape), torch.tensor([1, 7]),
                            torch.tensor([5.0, -5.0]))  # fmt: skip
        engine.send_patches([patch], "patched")
        assert reference_digest(sparse) != before
        engine.send_patches([SparsePatch(patch.name, patch.shape, patch.indices, norm[[1, 7]])])
        assert reference_digest(sparse) == before  # patched back
        assert reference_digest(disk) == before  # V1 too
        client = HTTPWeightSyncClient(disk.url)
        info = DiskTrainerInitInfo(directory=str(tmp_path / "sync"))
        engine = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v1_trainer))
        engine.send_weights("from-disk")
        assert client.weight_info() == {"weight_version": "from-disk", "version": 1,
                                        "digest": before, "weight_gen": 1,
                                        "weight_label": "from-disk"}  # fmt: skip
