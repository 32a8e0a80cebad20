"""One real `hotswap serve` process shared by the OpenAI API tests (starting one costs
seconds): float32 so greedy output does not depend on batching or the prefix cache, the
control plane for abort/pause checks, and prompt-token details on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import RemoteServer

MODEL = "tiny"
MAX_MODEL_LEN = 512
SERVER_ARGS = (
    "--served-model-name",
    MODEL,
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-kv-blocks",
    "128",
    "--log-level",
    "warning",
)


@pytest.fixture(scope="package")
def server(tiny_llama: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        tiny_llama, *SERVER_ARGS, "--enable-control", "--enable-prompt-tokens-details"
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="package")
def client(server: RemoteServer):  # noqa: ANN201 - openai.OpenAI
    return server.openai()


@pytest.fixture(scope="package")
def http(server: RemoteServer):  # noqa: ANN201 - httpx.Client
    with server.client() as c:
        yield c
