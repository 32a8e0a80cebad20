"""Building and loading the CPU kernels across processes: a builder killed mid-build
(torch's lock file left behind) must not make later engine starts wait forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap.model.kernels import load_cpu_kernels
from hotswap.model.kernels.build import _builder_lock, library_dir

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the engine runs on torch operators here",
)

LOAD = "from hotswap.model.kernels import load_cpu_kernels; print(load_cpu_kernels(False))"


def load_in_subprocess(cache: Path, timeout: float) -> str:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          env=env, timeout=timeout, check=True)  # fmt: skip
    return done.stdout.strip()


def test_a_built_library_loads_past_a_dead_builders_lock_file(tmp_path: Path) -> None:
    assert load_cpu_kernels(progress=False)
    built = library_dir()  # this machine's build, copied into a cache of the test's own
    target = tmp_path / built.relative_to(built.parent.parent.parent)
    target.mkdir(parents=True)
    shutil.copy(built / f"{built.name}.so", target)
    (target / "lock").touch()  # torch's lock file, as a builder killed inside its build leaves it
    assert load_in_subprocess(tmp_path, timeout=60) == "True"  # before: waited forever


def test_a_builder_clears_a_dead_builders_lock_file(tmp_path: Path) -> None:
    """The build path: holding the flock, torch's lock file can only be a dead builder's,
    so it is removed before the build starts (a fresh build itself runs once per machine,
    in the suite's first engine start)."""
    (tmp_path / "lock").touch()
    with _builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert (tmp_path / "builder.flock").exists()
