"""PipelineRL's weight updates end to end (pipelinerl/finetune_loop.py
`WeightUpdateManager`, pipelinerl/vllm1.py), against a real `hotswap serve`: the trainer
makes rank 0 of its group as PipelineRL's trainer did with `init_extra_process_group`
(torch's helpers under the name "actor", tests/helpers/torch_groups.py; gloo here, NCCL
there) while the server joins it, posts `/receive_weight_update` with its literal message
and, while that call is in flight, broadcasts each parameter in order with
`dist.broadcast(p, src=0, group=...)`. The server pauses keeping requests (a stream in
flight survives), receives, commits the version, resumes; checked against a fresh engine
on the same weights. (PipelineRL's current StatelessProcessGroup + PyNccl group cannot be
met: see hotswap/entrypoints/pipelinerl/routes.py.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer.trainer import run_alongside
from tests.helpers.server import RemoteServer
from tests.helpers.torch_groups import pipelinerl_group
from tests.weight_transfer.conftest import free_port, trainer_model

# Every test here talks to a server (its own process and engine): slow.
pytestmark = pytest.mark.slow

PROMPT = "The quick brown"
ROUND_CLOSED = 'hotswap:weight_round_open{model_name="tiny"} 0.0'


@pytest.fixture(scope="module")
def server(v1_dir: Path) -> Iterator[RemoteServer]:
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
            "--weight-transfer-config", '{"backend": "gloo"}')  # fmt: skip
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


def completion(max_tokens: int = 10, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip


def complete(http: httpx.Client) -> list[int]:
    response = http.post("/v1/completions", json=completion())
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def settled(http: httpx.Client) -> dict:
    """The server is generating, no round is open; returns /weight_info."""
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert ROUND_CLOSED in http.get("/metrics").text
    return http.get("/weight_info").json()


def message(version: object, parameters_info: object) -> dict:
    """PipelineRL's WeightUpdateRequest.model_dump()."""
    return {"kind": "weight_update_request", "version": version,
            "parameters_info": parameters_info, "timestamp": time.time()}  # fmt: skip


def parameters_info(named: list[tuple[str, torch.Tensor]]) -> list[dict]:
    return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in named]


def send(
    url: str, group: dist.ProcessGroup, version: object, named: list[tuple[str, torch.Tensor]]
) -> httpx.Response:
    """The trainer's send_weight_update: post the request, broadcast each parameter while
    it runs, then wait for the answer."""
    answer: dict[str, httpx.Response] = {}

    def post() -> None:
        body = message(version, parameters_info(named))
        answer["r"] = httpx.post(f"{url}/receive_weight_update", json=body, timeout=120)

    def broadcast() -> None:
        for _, tensor in named:
            dist.broadcast(tensor.detach(), src=0, group=group)

    run_alongside(post, broadcast)
    return answer["r"]


def init_group(url: str) -> dist.ProcessGroup:
    """The engine joins as rank 1 (actor 0 of one GPU each), with the group name left to
    its default ("actor", as PipelineRL's calls named it); the trainer makes rank 0."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    body = {"actor_idx": 0, "actor_ngpus": 1, "weight_update_group_init_method": init_method,
            "weight_update_group_world_size": 2}  # fmt: skip

    def post() -> None:
        r = httpx.post(f"{url}/init_actor_update_group", json=body, timeout=120)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text

    return run_alongside(post, lambda: pipelinerl_group(init_method, 2))


class Stream(threading.Thread):
    """A long streaming completion in flight across the update."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started, self.tokens, self.finish = threading.Event(), [], None

    def run(self) -> None:
        body = completion(self.max_tokens, stream=True)
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    self.tokens += choice.get("token_ids") or []
                    self.finish = choice.get("finish_reason") or self.finish
                    self.started.set()


@pytest.fixture
def trainer_groups() -> Iterator[list[dist.ProcessGroup]]:
    """The trainer's groups made in a test, destroyed after it."""
    groups: list[dist.ProcessGroup] = []
    yield groups
    for group in groups:
        dist.destroy_process_group(group)


def test_receive_weight_update(http, server, trainer_groups, v1_dir, v2_dir) -> None:
    v1_digest, v1_tokens = reference(v1_dir)
    v2_digest, v2_tokens = reference(v2_dir)
    assert v1_digest != v2_digest and v1_tokens != v2_tokens
    v2 = list(trainer_model(v2_dir).named_parameters())
    # Before the group exists: refused, generation resumed, nothing changed.
    before = settled(http)
    r = httpx.post(f"{server.url}/receive_weight_update", json=message(1, parameters_info(v2)))
    assert r.status_code == 409 and "init_weight_transfer_engine" in r.text, r.text
    assert settled(http) == before
    group = init_group(server.url)
    trainer_groups.append(group)
    assert complete(http) == v1_tokens
    stream = Stream(server.url, 400)
    stream.start()
    assert stream.started.wait(60)
    r = send(server.url, group, 1, v2)
    assert stream.is_alive() and len(stream.tokens) < 400  # it was in flight
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    stream.join(120)
    # keep mode: the request in flight was frozen, not aborted (its KV kept).
    assert (stream.finish, len(stream.tokens)) == ("length", 400)
    info = settled(http)
    assert (info["digest"], info["weight_version"], info["version"]) == (v2_digest, "1", 1)
    assert complete(http) == v2_tokens
    # A name the model lacks: the broadcast is drained, refused, the round aborted.
    r = send(server.url, group, 2, [("model.not_a_weight", torch.ones(4))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.parameters_info"
    assert "not_a_weight" in r.json()["error"]["message"]
    assert settled(http) == info
    # The group still works: back to V1.
    r = send(server.url, group, 2, list(trainer_model(v1_dir).named_parameters()))
    assert r.status_code == 200, r.text
    info = settled(http)
    assert (info["digest"], info["weight_version"], info["version"]) == (v1_digest, "2", 2)
    assert complete(http) == v1_tokens


GOOD = [{"name": "model.norm.weight", "shape": [64], "dtype": "torch.float32"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"parameters_info": GOOD}, "body.version"),
        (message("3", GOOD), "body.version"),
        (message(True, GOOD), "body.version"),
        (message(-1, GOOD), "body.version"),
        (message(3, []), "body.parameters_info"),
        (message(3, {"name": "x"}), "body.parameters_info"),
        (message(3, [None]), "body.parameters_info[0]"),
        (message(3, [{**GOOD[0], "name": ""}]), "body.parameters_info[0].name"),
        (message(3, [GOOD[0], GOOD[0]]), "body.parameters_info[1].name"),
        (message(3, [{**GOOD[0], "shape": [-1]}]), "body.parameters_info[0].shape"),
        (message(3, [{**GOOD[0], "shape": "64"}]), "body.parameters_info[0].shape"),
        (message(3, [{**GOOD[0], "dtype": "torch.complex64"}]), "body.parameters_info[0].dtype"),
    ],
)
def test_bad_payloads_change_nothing(http, body, param) -> None:
    before = settled(http)
    r = http.post("/receive_weight_update", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert settled(http) == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"actor_idx": 0, "actor_ngpus": 1, "weight_update_group_world_size": 2},
         "body.weight_update_group_init_method"),
        ({"actor_idx": 0, "actor_ngpus": 1, "weight_update_group_world_size": 2,
          "weight_update_group_init_method": "env://"}, "body.weight_update_group_init_method"),
        ({"actor_idx": 1, "actor_ngpus": 1, "weight_update_group_world_size": 2,
          "weight_update_group_init_method": "tcp://127.0.0.1:1"}, "body.actor_idx"),
        ({"actor_idx": 0, "actor_ngpus": 0, "weight_update_group_world_size": 2,
          "weight_update_group_init_method": "tcp://127.0.0.1:1"}, "body.actor_ngpus"),
        ({"actor_idx": 0, "actor_ngpus": 1, "weight_update_group_world_size": 1,
          "weight_update_group_init_method": "tcp://127.0.0.1:1"},
         "body.weight_update_group_world_size"),
        ({"actor_idx": 0, "actor_ngpus": 1, "weight_update_group_world_size": 2,
          "weight_update_group_init_method": "tcp://127.0.0.1:1", "group_name": ""},
         "body.group_name"),
        ({"actor_idx": 0, "actor_ngpus": 1, "weight_update_group_world_size": 2,
          "weight_update_group_init_method": "tcp://127.0.0.1:1", "group_name": "g" * 300},
         "body.group_name"),
    ],
)  # fmt: skip
def test_bad_init(http, body, param) -> None:
    r = http.post("/init_actor_update_group", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
