"""Disk reloads read only inside the directories allowed at server start
(`--allowed-weight-dirs`, default: the model directory's parent). Symlinks are resolved for
the directory and for every file read, the index and the files its weight_map names
included; anything outside is refused 400 naming `body.model_path`, nothing staged.

Every refused checkpoint here is a valid one (v2's weights), so the old code loaded it."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotswap import LLM
from hotswap.config import allowed_weight_dirs
from hotswap.engine_args import EngineArgs
from hotswap.entrypoints.cli import build_parser, engine_kwargs
from tests.helpers.server import RemoteServer
from tests.reliability.conftest import ARGS, assert_unharmed, weight_state

# Servers and engines (disk rounds): slow.
pytestmark = pytest.mark.slow

CKPT = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Dirs:
    allowed: Path  # given to --allowed-weight-dirs; holds v1/ and v2/
    outside: Path  # holds v2/, a valid checkpoint nobody allowed


def _checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    shutil.copyfile(src / CKPT, dst / CKPT)
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, v1_dir: Path, v2_dir: Path) -> Dirs:
    allowed, outside = tmp_path_factory.mktemp("allowed"), tmp_path_factory.mktemp("outside")
    _checkpoint(v1_dir, allowed / "v1")
    _checkpoint(v2_dir, allowed / "v2")
    _checkpoint(v2_dir, outside / "v2")
    (outside / "v2" / INDEX).write_text(json.dumps({"weight_map": {"x": CKPT}}))
    return Dirs(allowed, outside)


@pytest.fixture(scope="module")
def server(v1_dir: Path, dirs: Dirs):
    with RemoteServer(v1_dir, *ARGS, "--allowed-weight-dirs", str(dirs.allowed)) as srv:
        yield srv


def _case(dirs: Dirs, name: str) -> Path:
    """A fresh directory inside the allowed one, for one way of reaching outside it."""
    case = dirs.allowed / name
    case.mkdir()
    return case


def _index_naming(case: Path, target: str) -> None:
    (case / INDEX).write_text(json.dumps({"weight_map": {"model.norm.weight": target}}))


def _escape(dirs: Dirs, kind: str) -> str:
    """A model_path whose checkpoint is read from outside the allowed directory."""
    source = dirs.outside / "v2"
    if kind == "outside":
        return str(source)
    if kind == "dotdot":  # lexically under the allowed directory
        return f"{dirs.allowed}/../{dirs.outside.name}/v2"
    case = _case(dirs, kind)
    if kind == "dir-symlink":
        (case / "link").symlink_to(source, target_is_directory=True)
        return str(case / "link")
    if kind == "file-symlink":
        (case / CKPT).symlink_to(source / CKPT)
    elif kind == "index-dotdot":
        _index_naming(case, os.path.relpath(source / CKPT, case))
    elif kind == "index-absolute":
        _index_naming(case, str(source / CKPT))
    elif kind == "index-symlink":  # the files it names are inside; the index itself is not
        shutil.copyfile(source / CKPT, case / CKPT)
        (case / INDEX).symlink_to(source / INDEX)
    return str(case)


@pytest.mark.parametrize(
    "kind",
    ["outside", "dotdot", "dir-symlink", "file-symlink", "index-dotdot", "index-absolute",
     "index-symlink"],
)  # fmt: skip
def test_reload_from_outside_the_allowed_dirs_is_400(server, dirs: Dirs, kind: str) -> None:
    before = weight_state(server)
    with server.client() as client:
        r = client.post("/update_weights_from_disk", json={"model_path": _escape(dirs, kind)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "body.model_path", error
        assert "outside the directories weights may be loaded from" in error["message"]
        assert str(dirs.allowed) in error["message"]  # says what is allowed
        assert_unharmed(server, client, before)


def test_nonexistent_path_outside_reveals_nothing(server) -> None:
    """Confinement comes first: whether a path outside exists is not the caller's business."""
    with server.client() as client:
        r = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert r.status_code == 400 and "outside the directories" in r.json()["error"]["message"]


def test_reload_inside_the_allowed_dirs_works(server, dirs: Dirs) -> None:
    """Also through a symlink that stays inside."""
    alias = _case(dirs, "inside-alias") / "v2"
    alias.symlink_to(dirs.allowed / "v2", target_is_directory=True)
    with server.client() as client:
        start = weight_state(server)
        r = client.post("/update_weights_from_disk", json={"model_path": str(alias)})
        assert r.status_code == 200, r.text
        assert weight_state(server)["digest"] != start["digest"]
        r = client.post("/update_weights_from_disk", json={"model_path": str(dirs.allowed / "v1")})
        assert r.status_code == 200, r.text
        assert weight_state(server)["digest"] == start["digest"]


def test_disk_backend_round_is_confined(v1_dir: Path, dirs: Dirs) -> None:
    """The `disk` weight-transfer backend reads through the same allow-list."""
    llm = LLM(
        str(v1_dir),
        dtype="float32",
        progress=False,
        weight_transfer_config={"backend": "disk"},
        allowed_weight_dirs=[str(dirs.allowed)],
    )
    before = llm.get_weight_info()
    llm.start_weight_update()
    with pytest.raises(ValueError, match="^model_path: .* outside the directories"):
        llm.update_weights({"model_path": str(dirs.outside / "v2")})
    llm.finish_weight_update(abort=True)
    assert llm.get_weight_info() == before
    llm.start_weight_update()
    assert llm.update_weights({"model_path": str(dirs.allowed / "v2")}) > 0
    llm.finish_weight_update("v2")
    assert llm.get_weight_info()["digest"] != before["digest"]


def test_default_is_the_model_directorys_parent(v1_dir: Path, v2_dir: Path, tmp_path: Path) -> None:
    """The Python API confines too: without allowed_weight_dirs, a reload may read only
    beside the model (where tests' tmp dirs live: pytest puts them under one root)."""
    model = tmp_path / "models" / "m"
    shutil.copytree(v1_dir, model)
    sibling = _checkpoint(v2_dir, tmp_path / "models" / "v2")
    elsewhere = _checkpoint(v2_dir, tmp_path / "elsewhere" / "v2")
    llm = LLM(str(model), dtype="float32", progress=False)
    before = llm.get_weight_info()
    with pytest.raises(ValueError, match="outside the directories"):
        llm.engine.weight_manager.load_from_disk(str(elsewhere))
    assert llm.get_weight_info() == before
    llm.engine.weight_manager.load_from_disk(str(sibling))
    assert llm.get_weight_info()["digest"] != before["digest"]


def test_allowed_weight_dirs_flag_and_field(v1_dir: Path, tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "m", "--allowed-weight-dirs", "/a", "/b"])
    assert engine_kwargs(args)["allowed_weight_dirs"] == ["/a", "/b"]
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    # Resolved once, at start; a single path is a list of one.
    assert allowed_weight_dirs([str(link)], tmp_path) == (tmp_path.resolve() / "real",)
    assert allowed_weight_dirs(str(link), tmp_path) == (tmp_path.resolve() / "real",)
    assert allowed_weight_dirs(None, link) == (tmp_path.resolve(),)
    with pytest.raises(ValueError, match="allowed_weight_dirs"):
        EngineArgs(str(v1_dir), allowed_weight_dirs=[1]).create_engine_config()  # type: ignore[list-item]
