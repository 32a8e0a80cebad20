"""Servers shared by the reliability tests: each refused input must leave them healthy, on
the same weights, with no round open, so one server per backend serves a whole module."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import RemoteServer

ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control")


@pytest.fixture(scope="module")
def ipc_server(v1_dir):
    with RemoteServer(v1_dir, *ARGS, "--weight-transfer-config", '{"backend": "ipc"}') as srv:
        yield srv


@pytest.fixture(scope="module")
def gloo_server(v1_dir):
    config = json.dumps(
        {"backend": "gloo", "round_timeout_s": 3, "allowed_master_addresses": ["127.0.0.1"]}
    )
    with RemoteServer(v1_dir, *ARGS, "--weight-transfer-config", config) as srv:
        yield srv


def weight_state(server: RemoteServer) -> dict:
    """What a refused input must not change: version, label and digest of the weights."""
    return httpx.get(f"{server.url}/weight_info", headers=server.headers, timeout=30).json()


def assert_unharmed(server: RemoteServer, client: httpx.Client, before: dict) -> None:
    """After a refused input: /health answers at once on a fresh connection and on the
    kept-alive one, the weights are unchanged and no round is left open."""
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert client.get("/health", timeout=5).status_code == 200
    assert weight_state(server) == before
    metrics = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
    assert 'hotswap:weight_round_open{model_name="tiny"} 0.0' in metrics


@pytest.fixture(scope="session")
def v2_trainer(v2_dir: Path):
    from tests.weight_transfer.conftest import trainer_model

    return trainer_model(v2_dir)
