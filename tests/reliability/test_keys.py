"""The API key: from the command line, a file or the environment (a command line is
visible to every local user); the Bearer scheme is case-insensitive (RFC 7235)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from hotswap.entrypoints.cli import api_key, build_parser
from hotswap.entrypoints.server.limits import bearer_matches
from tests.helpers.server import RemoteServer


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (b"Bearer k3y", True),
        (b"bearer k3y", True),
        (b"BEARER  k3y ", True),
        (b"Basic k3y", False),
        (b"Bearer k3y2", False),
        (b"k3y", False),
        (b"", False),
    ],
)
def test_bearer_scheme_is_case_insensitive(header: bytes, ok: bool) -> None:
    assert bearer_matches(header, b"k3y") is ok


def _serve_args(*extra: str):
    return build_parser().parse_args(["serve", "m", *extra])


def test_key_from_file_or_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("HOTSWAP_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_key(_serve_args()) == "from-vllm"
    monkeypatch.setenv("HOTSWAP_API_KEY", "from-env")
    assert api_key(_serve_args()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key(_serve_args("--api-key-file", str(key_file))) == "from-file"
    assert api_key(_serve_args("--api-key", "from-flag")) == "from-flag"
    with pytest.raises(ValueError, match="api-key-file"):
        api_key(_serve_args("--api-key-file", str(tmp_path / "missing")))


@pytest.mark.slow
def test_server_takes_the_key_from_the_environment(v1_dir) -> None:
    env = {"HOTSWAP_API_KEY": "s3cret"}
    with RemoteServer(v1_dir, "--served-model-name", "tiny", env=env) as server:
        url = f"{server.url}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.get(url, headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200, (scheme, r.text)
        assert httpx.get(f"{server.url}/health").status_code == 200
