"""Weight sources are what the trainer sent, nothing else: a shared-memory segment name is
opened without following links and only on the shared-memory filesystem; anything else is
refused 400 naming the field, and nothing is committed."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotswap.weight_transfer.shm import SHM_DIR, Segment
from tests.reliability.conftest import assert_unharmed, weight_state

NORM = "model.norm.weight"
NORM_INFO = {"names": [NORM], "dtype_names": ["float32"], "shapes": [[64]]}


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh name in /dev/shm, removed (whatever it became) after the test."""
    name = f"hotswap_test_{secrets.token_hex(6)}"
    yield name
    path = SHM_DIR / name
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.is_symlink() or path.exists():
        path.unlink()


def _target_file(tmp_path: Path) -> Path:
    target = tmp_path / "secret.bin"
    target.write_bytes(b"\x00\x00\x80\x3f" * 64)  # 64 float32 ones: a plausible norm weight
    return target


def test_attach_refuses_links_directories_and_fifos(tmp_path: Path, shm_name: str) -> None:
    path = SHM_DIR / shm_name
    path.symlink_to(_target_file(tmp_path))
    with pytest.raises(ValueError, match="is not a shared-memory segment"):
        Segment.attach(shm_name)
    path.unlink()
    path.mkdir()
    with pytest.raises(ValueError, match="is not a shared-memory segment"):
        Segment.attach(shm_name)
    path.rmdir()
    os.mkfifo(path)
    with pytest.raises(ValueError, match="is not a shared-memory segment"):
        Segment.attach(shm_name)  # and never blocks on the FIFO


def test_attach_refuses_a_link_to_another_segment(shm_name: str) -> None:
    real = Segment.create(256)
    (SHM_DIR / shm_name).symlink_to(real.path)
    with pytest.raises(ValueError, match="is not a shared-memory segment"):
        Segment.attach(shm_name)
    assert Segment.attach(real.name).size == 256  # the segment itself is fine


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_segment_that_is_not_a_segment_is_refused_over_http(
    ipc_server, tmp_path: Path, shm_name: str, kind: str
) -> None:
    before = weight_state(ipc_server)
    path = SHM_DIR / shm_name
    if kind == "symlink":
        path.symlink_to(_target_file(tmp_path))
    else:
        path.mkdir()
    with ipc_server.client() as client:
        assert client.post("/start_weight_update").status_code == 200
        update = {**NORM_INFO, "segments": [shm_name], "placements": [[0, 0]]}
        r = client.post("/update_weights", json={"update_info": update})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (
            "segments[0]" in error["message"] and "not a shared-memory segment" in error["message"]
        )
        assert client.post("/finish_weight_update", json={"abort": True}).status_code == 200
        assert_unharmed(ipc_server, client, before)


@pytest.mark.slow
def test_wrong_shape_is_refused_naming_the_shape(ipc_server) -> None:
    before = weight_state(ipc_server)
    segment = Segment.create(64)  # too small for what the sender claims: shape comes first
    info = {"names": [NORM], "dtype_names": ["float32"], "shapes": [[4096]]}
    with ipc_server.client() as client:
        assert client.post("/start_weight_update").status_code == 200
        update = {**info, "segments": [segment.name], "placements": [[0, 0]]}
        r = client.post("/update_weights", json={"update_info": update})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "shape mismatch" in message and "[4096]" in message and "[64]" in message
        assert client.post("/finish_weight_update", json={"abort": True}).status_code == 200
        assert_unharmed(ipc_server, client, before)
