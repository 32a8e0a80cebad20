"""AReaL's vLLM-server calls end to end (areal/engine/vllm_remote.py `VLLMBackend`, driven by
areal/engine/fsdp_engine.py), against a real `hotswap serve`: the trainer makes rank 0
of its group as AReaL does (`init_custom_process_group`: torch's helpers under the group
name, tests/helpers/torch_groups.py) while the server joins it, pauses generation, sends
its parameters in buckets (set the meta, then the xccl update while it posts one
`dist.broadcast` per tensor of the bucket and waits for them), continues; then a disk
update. Checked against a fresh engine on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer.trainer import run_alongside
from tests.helpers.server import RemoteServer
from tests.helpers.torch_groups import areal_group
from tests.weight_transfer.conftest import free_port, trainer_model

# Every test here talks to a server (its own process and engine): slow.
pytestmark = pytest.mark.slow

PROMPT = "The quick brown"
ROUND_CLOSED = 'hotswap:weight_round_open{model_name="tiny"} 0.0'
GROUP = "update_weight_group"


@pytest.fixture(scope="module")
def server(v1_dir: Path) -> Iterator[RemoteServer]:
    config = '{"backend": "gloo", "allowed_master_addresses": ["127.0.0.1"]}'
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
            "--weight-transfer-config", config)  # fmt: skip
    with RemoteServer(v1_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def reference(model_dir: Path) -> tuple[str, list[int]]:
    """A fresh engine on `model_dir`: its weight digest and greedy tokens."""
    llm = LLM(str(model_dir), dtype="float32", progress=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    return llm.get_weight_info()["digest"], list(tokens)


def complete(http: httpx.Client) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def weights(http: httpx.Client, paused: bool = False) -> dict:
    """No round is open and the pause state is as expected; returns /weight_info."""
    assert http.get("/is_paused").json() == {"is_paused": paused}
    assert ROUND_CLOSED in http.get("/metrics").text
    return http.get("/weight_info").json()


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True, response.text
    return response.json()


@pytest.fixture(scope="module")
def group(server: RemoteServer) -> Iterator[dist.ProcessGroup]:
    """_init_weight_update_from_distributed with one server (tp = pp = 1): the request
    (build_init_weights_group_request: rank_offset 1) in flight while the trainer makes
    rank 0 with init_custom_process_group."""
    url, port = server.url, free_port()
    body = {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "group_name": GROUP}  # fmt: skip
    pg = run_alongside(
        lambda: ok(httpx.post(f"{url}/areal_init_weights_update_group", json=body, timeout=120)),
        lambda: areal_group("127.0.0.1", port, 2, GROUP),
    )
    yield pg
    dist.destroy_process_group(pg)


def meta(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """build_distributed_weight_update_requests: ParamSpec dtypes without "torch."."""
    return {"names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).split("torch.")[1] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP}  # fmt: skip


def send_bucket(
    url: str, group: dist.ProcessGroup, bucket: list[tuple[str, torch.Tensor]]
) -> httpx.Response:
    """One bucket (_update_bucket_weights_from_distributed_async): the meta, then the update
    in flight while the trainer posts `dist.broadcast(t, src=0, group, async_op=True)` for
    each tensor, waits for them all, then for the answer."""
    ok(httpx.post(f"{url}/areal_set_update_weight_meta", json=meta(bucket), timeout=60))
    answer: dict[str, httpx.Response] = {}

    def update() -> None:
        answer["r"] = httpx.post(f"{url}/areal_update_weights_xccl", json={}, timeout=120)

    def broadcast() -> None:
        handles = [dist.broadcast(tensor.detach(), src=0, group=group, async_op=True)
                   for _, tensor in bucket]  # fmt: skip
        for handle in handles:
            handle.wait()

    run_alongside(update, broadcast)
    return answer["r"]


def test_xccl_buckets_then_disk(http, server, group, v1_dir, v2_dir) -> None:
    v1_digest, v1_tokens = reference(v1_dir)
    v2_digest, v2_tokens = reference(v2_dir)
    assert v1_digest != v2_digest and v1_tokens != v2_tokens
    before = weights(http)
    assert complete(http) == v1_tokens
    params = list(trainer_model(v2_dir).named_parameters())
    buckets = [params[: len(params) // 2], params[len(params) // 2 :]]
    ok(http.post("/areal_pause_generation", json={}))
    for i, bucket in enumerate(buckets):
        ok(send_bucket(server.url, group, bucket))
        info = weights(http, paused=True)  # AReaL's pause holds across buckets
        assert (info["weight_version"], info["version"]) == (
            before["weight_version"], before["version"] + i + 1
        )  # fmt: skip
    assert info["digest"] == v2_digest
    # A bucket the model cannot take (a shape): drained, refused, nothing applied.
    name, tensor = params[0]
    r = send_bucket(server.url, group, [(name, torch.zeros(tensor.shape[0] + 1))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.meta", r.text
    assert "shape" in r.json()["error"]["message"]
    assert weights(http, paused=True) == info
    ok(http.post("/areal_continue_generation", json={}))
    assert weights(http) == info
    assert complete(http) == v2_tokens
    # The disk update, while generating: pauses and resumes itself.
    ok(http.post("/areal_update_weights", json={"model_path": str(v1_dir)}))
    info = weights(http)
    assert (info["digest"], info["weight_version"]) == (v1_digest, str(v1_dir))
    assert complete(http) == v1_tokens
    # The group still works after all that: one bucket back to V2, not paused before.
    ok(send_bucket(server.url, group, params))
    assert weights(http)["digest"] == v2_digest
    assert complete(http) == v2_tokens


def meta_body(**changes: object) -> dict:
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
            "group_name": GROUP}  # fmt: skip
    return {**body, **changes}


INIT = {"master_address": "127.0.0.1", "master_port": "1", "rank_offset": 1, "world_size": 2,
        "backend": "gloo", "group_name": GROUP}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/areal_set_update_weight_meta", meta_body(group_name="other"), 400, "body.group_name"),
        ("/areal_set_update_weight_meta", meta_body(dtypes=["complex64"]), 400, "body.dtypes[0]"),
        ("/areal_set_update_weight_meta", meta_body(dtypes=[]), 400, "body.names"),
        ("/areal_set_update_weight_meta", meta_body(names=[]), 400, "body.names"),
        ("/areal_set_update_weight_meta", meta_body(names=[""]), 400, "body.names[0]"),
        ("/areal_set_update_weight_meta", meta_body(shapes=[[-1]]), 400, "body.shapes[0]"),
        ("/areal_set_update_weight_meta", meta_body(shapes=None), 400, "body.shapes"),
        ("/areal_update_weights_xccl", {}, 409, None),  # no meta set
        ("/areal_init_weights_update_group", {**INIT, "backend": "nccl"}, 400, "body.backend"),
        ("/areal_init_weights_update_group", {**INIT, "master_port": "x"}, 400,
         "body.master_port"),
        ("/areal_init_weights_update_group", {**INIT, "master_port": 70000}, 400,
         "body.master_port"),
        ("/areal_init_weights_update_group", {**INIT, "world_size": "2"}, 400, "body.world_size"),
        ("/areal_init_weights_update_group", {**INIT, "group_name": ""}, 400,
         "body.group_name"),
        ("/areal_update_weights", {}, 400, "body.model_path"),
        ("/areal_update_weights", {"model_path": "/nonexistent"}, 400, "body.model_path"),
        ("/areal_update_weights", {"model_path": "/x", "load_format": "pt"}, 400,
         "body.load_format"),
        ("/areal_update_weights_lora", {}, 501, None),
        ("/areal_update_weights_lora_xccl", {}, 501, None),
    ],
)  # fmt: skip
def test_bad_payloads_change_nothing(http, group, path, body, status, param) -> None:
    before = weights(http)
    r = http.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert weights(http) == before


def test_engine_refusal_names_the_body_field(http, group) -> None:
    """An init the engine itself refuses (a master address not allowed) names the body's
    field, and leaves no group behind: a meta for it is refused. (Runs last.)"""
    r = http.post("/areal_init_weights_update_group", json={**INIT, "master_address": "[::2]"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.master_address", r.text
    assert r.json()["error"]["message"].startswith("master_address: '::2'"), r.text
    r = http.post("/areal_set_update_weight_meta", json=meta_body())
    assert r.status_code == 409 and "/areal_init_weights_update_group" in r.text
