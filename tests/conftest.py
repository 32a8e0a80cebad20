from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

# The suite runs its engines eagerly: compiling decode steps costs seconds per engine (a
# minute the first time on a machine). torch's own switch, so engine subprocesses the
# tests start inherit it; tests/execution/test_compiled.py turns compilation back on.
os.environ["TORCH_COMPILE_DISABLE"] = "1"

import torch  # noqa: E402 - importing torch alone does not import Triton

# Without a GPU, the Triton kernels (hotswap/model/cuda) run under Triton's interpreter,
# which Triton reads when it is first imported: set before torch._dynamo imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402

torch._dynamo.config.disable = True

from tests.helpers.tiny_models import write_tiny_model  # noqa: E402

# The longest files, started first: `make test` runs 2 pytest-xdist workers that each take a
# whole file at a time (--dist loadfile), so a long file started last would run alone at
# the end. Order among the rest, and within every file, is unchanged.
LONGEST_FIRST = (
    "tests/examples/test_grpo_async.py",
    "tests/exactness/test_exactness.py",
    "tests/execution/test_cuda_graphs.py",
    "tests/examples/",
    "tests/engine/test_async_llm.py",
    "tests/ray/",
    "tests/execution/test_compiled.py",
    "tests/reliability/test_soak.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        found = (i for i, path in enumerate(LONGEST_FIRST) if item.nodeid.startswith(path))
        return next(found, len(LONGEST_FIRST))

    items.sort(key=rank)  # stable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


@pytest.fixture(scope="module", autouse=True)
def freed_memory_returned() -> Iterator[None]:
    """After each module, what its engines freed goes back to the OS: glibc keeps a freed
    heap (an engine on the default model, shut down and collected, left 2.28 GB resident
    where 0.49 GB remained after a trim), and `make test`'s two workers would otherwise
    each carry ~5 GB beside the servers and Ray actors of the tests they run."""
    yield
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Builds (once per session) a tiny random model directory per (arch, seed)."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            name = f"{arch}-{seed}-{len(cache)}"
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(name), arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def v1_dir(tiny_model_factory) -> Path:
    """The tiny Llama a weight update starts from (the weight tests' and dialects')."""
    return tiny_model_factory("llama", seed=0)


@pytest.fixture(scope="session")
def v2_dir(tiny_model_factory) -> Path:
    """The same architecture with other weights: what a round sends."""
    return tiny_model_factory("llama", seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Build hotswap's CPU kernels once, before any test starts an engine: inside a server
    subprocess the first build (~30 s) would count against the test's start-up wait."""
    from hotswap.model.kernels import load_cpu_kernels

    load_cpu_kernels(progress=False)
