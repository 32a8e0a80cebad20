"""vLLM's RL routes beyond the four phases, against a real `hotswap serve`:
`collective_rpc` with a worker extension named at start (a weight stream received by the
extension's own code), per-tensor checksums on finish, `/update_weight_label`,
`/weight_update_active`, and the `vllm:*` metric families."""

from __future__ import annotations

import hashlib
import threading
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import RemoteServer, concurrent_servers
from tests.weight_transfer.conftest import free_port

# Every test here talks to a server (its own process and engine): slow.
pytestmark = pytest.mark.slow

EXTENSION = "tests.helpers.gloo_extension:GlooReceiver"
ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control")
PROMPT = [5, 17, 42, 8, 99, 3]


@pytest.fixture(scope="module")
def servers(v1_dir):
    """The module's server (a worker extension, gloo), and a plain one (neither), started
    together."""
    args = (*ARGS, "--worker-extension-cls", EXTENSION, "--weight-transfer-config",
            '{"backend": "gloo"}')  # fmt: skip
    with concurrent_servers((v1_dir, *args), (v1_dir, *ARGS)) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers) -> RemoteServer:
    return servers[0]


@pytest.fixture(scope="module")
def plain_server(servers) -> RemoteServer:
    return servers[1]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def greedy(http: httpx.Client) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def reference(model_dir: Path) -> tuple[list[int], str]:
    """Greedy tokens and weight digest of a fresh engine on `model_dir`."""
    llm = LLM(str(model_dir), dtype="float32", progress=False)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8,
                       ignore_eos=True), use_tqdm=False)  # fmt: skip
    return list(out[0].outputs[0].token_ids), llm.get_weight_info()["digest"]


def in_thread(call) -> tuple[threading.Thread, list]:  # noqa: ANN001
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    return thread, result


def test_worker_extension_receives_a_weight_stream(server, http, v2_dir) -> None:
    before = greedy(http)
    expected_tokens, expected_digest = reference(v2_dir)
    tensors = load_file(v2_dir / "model.safetensors")
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    init = {"method": "init_group", "args": ["127.0.0.1", port, 2, 1]}
    thread, answer = in_thread(lambda: http.post("/collective_rpc", json=init))
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    thread.join(60)
    assert answer[0].status_code == 200 and answer[0].json() == {
        "results": ["joined as rank 1 of 2"]
    }
    names = sorted(tensors)
    receive = {"method": "receive", "kwargs": {
        "names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(tensors[n].shape) for n in names]}}  # fmt: skip
    thread, answer = in_thread(lambda: http.post("/collective_rpc", json=receive))
    for name in names:
        group.broadcast(tensors[name].contiguous(), 0).wait()
    thread.join(60)
    assert answer[0].json() == {"results": [len(names)]}
    # Loaded by the extension, not committed: the version names it once it is.
    assert http.post("/update_weight_version", json={"new_version": "rpc-1"}).status_code == 200
    info = http.get("/weight_info").json()
    assert info["digest"] == expected_digest and info["weight_version"] == "rpc-1"
    assert greedy(http) == expected_tokens != before


def test_collective_rpc_only_calls_declared_methods(server, http) -> None:
    ok = http.post("/collective_rpc", json={"method": "rank_and_device"})
    assert ok.json() == {"results": [{"rank": 0, "device": "cpu"}]}
    for method in ("load_weights", "__init__", "_private", "model_runner", "shutdown"):
        r = http.post("/collective_rpc", json={"method": method})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.method", r.text
    r = http.post("/collective_rpc", json={"method": "rank_and_device", "args": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.args"
    r = http.post("/collective_rpc", json={"args": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.method"


def test_collective_rpc_needs_an_extension(plain_server) -> None:
    r = httpx.post(f"{plain_server.url}/collective_rpc", json={"method": "rank_and_device"})
    assert r.status_code == 400 and "--worker-extension-cls" in r.json()["error"]["message"]


def test_finish_answers_per_tensor_checksums(server, http, v1_dir) -> None:
    from tests.weight_transfer.conftest import trainer_model

    client = HTTPWeightSyncClient(server.url)
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(trainer_model(v1_dir)))
    assert http.get("/weight_update_active").json() == {"weight_update_active": False}
    assert http.post("/start_weight_update", json={}).status_code == 200
    assert http.get("/weight_update_active").json() == {"weight_update_active": True}
    r = http.post("/finish_weight_update", json={"checksum": True, "weight_label": "ck"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert http.get("/weight_update_active").json() == {"weight_update_active": False}
    assert answer["weight_version"] == answer["weight_label"] == "ck"
    assert answer["weight_gen"] == answer["version"]
    # Independent reference: SHA-256 of each tensor of a fresh engine's model.
    llm = LLM(str(v1_dir), dtype="float32", progress=False)
    current = http.get("/weight_info").json()["digest"]
    if current == llm.get_weight_info()["digest"]:  # the extension test may have run first
        expected = {f"dp0:pp0:pcp0:tp0:ep0:{name}": _sha(p)
                    for name, p in llm.engine.runner.model.named_parameters()}  # fmt: skip
        assert answer["checksums"] == expected
    assert len(answer["checksums"]) == len(list(llm.engine.runner.model.parameters()))
    assert all(key.startswith("dp0:pp0:pcp0:tp0:ep0:") for key in answer["checksums"])


def _sha(param: torch.Tensor) -> str:
    return hashlib.sha256(
        param.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    ).hexdigest()


def test_update_weight_label_renames_without_a_commit(http) -> None:
    before = http.get("/weight_info").json()
    r = http.post("/update_weight_label", json={"weight_label": "renamed"})
    assert r.json() == {"weight_gen": before["version"], "weight_label": "renamed"}
    after = http.get("/weight_info").json()
    assert after["version"] == before["version"] and after["weight_version"] == "renamed"
    r = http.post("/update_weight_label", json={"weight_label": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.weight_label"
    r = http.post("/finish_weight_update", json={"weight_label": "a", "weight_version": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.weight_label"


def test_vllm_metric_families(server, http) -> None:
    version = http.get("/weight_info").json()["version"]
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:engine_sleep_state", "vllm:rl_weight_gen",
                 "vllm:rl_weight_update_active", "vllm:rl_weight_update",
                 "vllm:rl_weight_update_duration_seconds"):  # fmt: skip
        assert name in families, name
        assert all("engine" in s.labels for s in families[name].samples), name
    sleep = {s.labels["sleep_state"]: s.value for s in families["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    gen = families["vllm:rl_weight_gen"].samples[0].value
    assert gen == version
