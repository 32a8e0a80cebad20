"""The GPU data planes: CUDA IPC handles (a trainer's GPU tensors shared in place) and NCCL
broadcast, into engines running on CUDA. Skipped without CUDA (CI has none); run them on a
GPU machine with `pytest tests/weight_transfer/test_cuda.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hotswap import LLM
from hotswap.weight_transfer import (
    HTTPWeightSyncClient,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    NCCLTrainerInitInfo,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import RemoteServer
from tests.weight_transfer.conftest import free_port, trainer_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control")


def cpu_digest(path: Path) -> str:
    return LLM(str(path), dtype="float32", progress=False).get_weight_info()["digest"]


def server_digest(client: HTTPWeightSyncClient) -> str:
    return client.weight_info()["digest"]


def test_cuda_ipc_into_an_in_process_cuda_engine(v1_dir, v2_dir) -> None:
    config = {"backend": "ipc", "require_complete": True}
    llm = LLM(str(v1_dir), dtype="float32", device="cuda", progress=False,
              weight_transfer_config=config)  # fmt: skip
    trainer = trainer_model(v2_dir).cuda()
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), InProcessWeightSyncClient(llm), ModuleSource(trainer)
    )
    engine.send_weights("v2")
    assert llm.get_weight_info()["digest"] == cpu_digest(v2_dir)


def test_cuda_ipc_across_processes(v1_dir, v2_dir) -> None:
    config = '{"backend": "ipc", "require_complete": true}'
    trainer = trainer_model(v2_dir).cuda()
    with RemoteServer(v1_dir, *ARGS, "--device", "cuda", "--weight-transfer-config", config) as s:
        client = HTTPWeightSyncClient(s.url)
        WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(), client, ModuleSource(trainer)
        ).send_weights("v2")
        assert server_digest(client) == cpu_digest(v2_dir)
        with torch.no_grad():  # train in place, send again: the handles see the new values
            trainer.model.norm.weight.add_(1.0)
        WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(), client, ModuleSource(trainer)
        ).send_weights("v2+1")
        assert server_digest(client) != cpu_digest(v2_dir)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("packed", [True, False])
def test_nccl_broadcast_into_a_cuda_server(v1_dir, v2_dir, packed: bool) -> None:
    config = '{"backend": "nccl", "require_complete": true}'
    trainer = trainer_model(v2_dir).to("cuda:0")
    with RemoteServer(v1_dir, *ARGS, "--device", "cuda:1", "--weight-transfer-config", config) as s:
        client = HTTPWeightSyncClient(s.url)
        info = NCCLTrainerInitInfo(master_port=free_port(), world_size=2, packed=packed,
                                   device="cuda:0")  # fmt: skip
        sender = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(trainer))
        sender.send_weights()
        assert server_digest(client) == cpu_digest(v2_dir)
