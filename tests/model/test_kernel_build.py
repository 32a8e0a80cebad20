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
from hotswap.model.kernels.build import library_dir

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


@pytest.mark.slow
def test_a_build_proceeds_past_a_dead_builders_lock_file(tmp_path: Path) -> None:
    target = tmp_path / library_dir().relative_to(library_dir().parent.parent.parent)
    target.mkdir(parents=True)
    (target / "lock").touch()
    assert load_in_subprocess(tmp_path, timeout=600) == "True"  # built from scratch
    assert (target / f"{target.name}.so").exists()
