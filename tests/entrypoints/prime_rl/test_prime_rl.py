"""prime-rl's inference-server calls end to end (src/prime_rl/utils/client.py), against a
real `hotswap serve`: the orchestrator pauses keeping requests, posts `/update_weights
{"weight_dir"}` for the checkpoint its trainer wrote (sharded safetensors, STABLE and
NCCL_READY markers beside them), resumes; checked against a fresh engine on the same
weights. vLLM's `{"update_info"}` chunks go through the same route."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import RemoteServer
from tests.weight_transfer.conftest import free_port, trainer_model

# Every test here talks to a server (its own process and engine): slow.
pytestmark = pytest.mark.slow

PROMPT = "The quick brown"
ROUND_CLOSED = 'hotswap:weight_round_open{model_name="tiny"} 0.0'


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Path:
    """prime-rl's output dir: broadcasts land in broadcasts/step_N."""
    return tmp_path_factory.mktemp("prime-rl-output")


@pytest.fixture(scope="module")
def server(v1_dir: Path, output_dir: Path) -> Iterator[RemoteServer]:
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
            "--allowed-weight-dirs", str(output_dir),
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


def complete(http: httpx.Client) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def write_broadcast(output_dir: Path, step: int, model_dir: Path) -> Path:
    """What prime-rl's filesystem broadcast leaves: an HF checkpoint in sharded
    safetensors under broadcasts/step_N, a STABLE marker, and the orchestrator's
    NCCL_READY marker."""
    save_dir = output_dir / "broadcasts" / f"step_{step}"
    trainer_model(model_dir).save_pretrained(save_dir, max_shard_size="200KB")
    assert len(list(save_dir.glob("model-*.safetensors"))) > 1  # really sharded
    (save_dir / "STABLE").touch()
    (save_dir / "NCCL_READY").touch()
    return save_dir


def settled(http: httpx.Client) -> dict:
    """The server is generating, no round is open; returns /weight_info."""
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert ROUND_CLOSED in http.get("/metrics").text
    return http.get("/weight_info").json()


def update(http: httpx.Client, weight_dir: Path | str | None) -> httpx.Response:
    """prime-rl's update_weights: pause keeping requests, update, always resume."""
    r = http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    assert r.json() == {"status": "paused"}
    try:
        return http.post(
            "/update_weights", json={"weight_dir": None if weight_dir is None else str(weight_dir)}
        )
    finally:
        assert http.post("/resume").json() == {"status": "resumed"}


def test_weight_dir_round(http, server, output_dir, v1_dir, v2_dir, v1_trainer_model) -> None:
    v1_digest, v1_tokens = reference(v1_dir)
    v2_digest, v2_tokens = reference(v2_dir)
    assert v1_digest != v2_digest and v1_tokens != v2_tokens
    assert http.get("/liveness").json() == {"status": "ok"}
    assert complete(http) == v1_tokens
    weight_dir = write_broadcast(output_dir, 1, v2_dir)
    r = update(http, weight_dir)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    info = settled(http)
    assert info["digest"] == v2_digest
    assert (info["weight_version"], info["version"]) == (str(weight_dir), 1)
    assert complete(http) == v2_tokens
    # vLLM's chunk body on the same route: a gloo round back to V1.
    client = HTTPWeightSyncClient(server.url)
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_port=free_port(), world_size=2), client,
        ModuleSource(v1_trainer_model),
    )  # fmt: skip
    engine.send_weights("back-to-v1")
    info = settled(http)
    assert (info["digest"], info["weight_version"], info["version"]) == (
        v1_digest, "back-to-v1", 2
    )  # fmt: skip
    assert complete(http) == v1_tokens


@pytest.fixture(scope="module")
def v1_trainer_model(v1_dir: Path):  # noqa: ANN201 - a transformers model
    return trainer_model(v1_dir)


def test_bad_payloads_change_nothing(http, output_dir, v2_dir, tmp_path) -> None:
    before = settled(http)
    outside = tmp_path / "step_9"  # not under --allowed-weight-dirs
    shutil.copytree(write_broadcast(output_dir, 9, v2_dir), outside)
    broken = output_dir / "broadcasts" / "step_10"
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    nccl_only = output_dir / "broadcasts" / "step_11"  # NCCL mode: only the marker
    nccl_only.mkdir(parents=True)
    (nccl_only / "NCCL_READY").touch()
    for weight_dir, fragment in [
        (None, "weight_dir: must be a path"),
        (output_dir / "missing", "weight_dir"),
        (outside, "outside the directories"),
        (broken, "weight_dir"),
        (nccl_only, "weight_dir"),
    ]:
        r = update(http, weight_dir)
        assert r.status_code == 400, (weight_dir, r.text)
        error = r.json()["error"]
        assert error["param"] == "body.weight_dir" and fragment in error["message"], error
        assert settled(http) == before
    r = http.post("/update_weights", json={"weight_dir": str(outside), "update_info": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    assert settled(http) == before


def test_init_broadcaster_refused_liveness_ok(http) -> None:
    """prime-rl's init_nccl_broadcast payload: its NCCL wire is not spoken here."""
    body = {"host": "127.0.0.1", "port": 29501, "rank_offset": 0, "inference_world_size": 1,
            "timeout": 1200, "quantize_in_weight_transfer": False}  # fmt: skip
    r = http.post("/init_broadcaster", json=body)
    assert r.status_code == 501 and "filesystem" in r.json()["error"]["message"]
    assert http.get("/liveness").json() == {"status": "ok"}
    assert settled(http)["version"] >= 0
