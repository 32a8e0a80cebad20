"""hotswap's import graph is acyclic and layered, and the core never imports ray.

The graph is read from the source with `ast` (nothing is imported), deferred imports
inside functions included."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.helpers.import_graph import (
    ImportGraph,
    build_graph,
    find_cycle,
    layer_violations,
    lazy_packages,
)

ROOT = Path(__file__).resolve().parents[1] / "hotswap"

# A module may import its own layer or lower ones. The longest matching entry wins; the
# top-level `hotswap` entry is `hotswap/__init__.py` alone (the public facade).
LAYERS = {
    # 0: leaves, no hotswap import beyond this layer
    "hotswap.sampling_params": 0,
    "hotswap.outputs": 0,
    "hotswap.tokenizer": 0,
    "hotswap.detokenizer": 0,
    "hotswap.default_model": 0,
    "hotswap.config": 0,
    "hotswap.engine_args": 0,
    "hotswap.flag_spec": 0,
    "hotswap.msgspec_errors": 0,
    "hotswap.weight_transfer.config": 0,
    "hotswap.weight_transfer.dtypes": 0,
    "hotswap.errors": 0,
    "hotswap.quantization": 0,  # FP8 configs and the quantizer (tensors in, tensors out)
    "hotswap.lora": 0,  # the package itself (empty); its modules by their own layers
    "hotswap.lora.request": 0,
    "hotswap.lora.files": 0,
    "hotswap.structured_output": 0,
    "hotswap.generation_config": 0,
    "hotswap.multimodal": 0,  # request images read and processed (PIL, numpy)
    # 1: the networks and their kernels; step execution beside them (runner, sampler, CUDA
    # graphs); what every rank does with its weights (its double buffer, the writes every
    # rank makes, residency while asleep, checkpoint files); LoRA adapters in the layers
    "hotswap.model": 1,
    "hotswap.execution": 1,
    "hotswap.weights.double_buffer": 1,
    "hotswap.weights.rank_writes": 1,
    "hotswap.weights.residency": 1,
    "hotswap.weights.checkpoint": 1,
    "hotswap.lora.adapter": 1,
    "hotswap.lora.experts": 1,
    "hotswap.lora.layers": 1,
    "hotswap.lora.stage": 1,
    # 2: weight-transfer backends, trainer side, clients
    "hotswap.weight_transfer": 2,
    # 3: scheduler, engine core, front-ends (LLM, AsyncLLM); the engine's weight rounds and
    # versions (hotswap.weights), its LoRA adapters by name; ranks 1.. as processes (they
    # answer the engine's RPCs)
    "hotswap.engine": 3,
    "hotswap.weights": 3,
    "hotswap.lora.manager": 3,
    "hotswap.lora.loaded": 3,  # what a front-end loaded, followed from its verbs' calls
    "hotswap.execution.rank_process": 3,
    # 4: the facade re-exporting LLM, AsyncLLM, SamplingParams, ...
    "hotswap": 4,
    # 5: applications of the engine
    "hotswap.rl": 5,
    "hotswap.entrypoints": 5,
    "hotswap.entrypoints.router": 5,  # `hotswap route`: over servers, through rl's EngineGroup
    "hotswap.lora.modules": 5,
    "hotswap.__main__": 5,
    # 6: the optional Ray integration; no other module may import it
    "hotswap.ray": 6,
    # ... but one: engine cores as Ray actors, a rank launcher for the data-parallel client
    # beside the process one, built from engine parts alone. AsyncLLM imports it, deferred,
    # when data_parallel_backend is "ray" (the `ray` import itself stays in hotswap.ray).
    "hotswap.ray.dp": 3,
    # ... and tensor-parallel worker ranks as Ray actors, which hotswap.ray.dp's cores place
    # on their groups (the model layer names it only as a module to load, for
    # distributed_executor_backend "ray")
    "hotswap.ray.ranks": 3,
}
RAY_PACKAGE = "hotswap.ray"


@functools.cache
def hotswap_graph() -> ImportGraph:
    return build_graph(ROOT, "hotswap")


def test_no_import_cycle() -> None:
    cycle = find_cycle(hotswap_graph().edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_layers_respected() -> None:
    assert layer_violations(hotswap_graph().edges, LAYERS) == []


def test_core_never_imports_ray() -> None:
    external = hotswap_graph().external
    core = [m for m in external if m != RAY_PACKAGE and not m.startswith(RAY_PACKAGE + ".")]
    assert [m for m in sorted(core) if "ray" in external[m]] == []


def test_no_import_through_lazy_facades() -> None:
    # A name read through a package's `__getattr__` hides its real module from the graph.
    lazy = lazy_packages(ROOT, "hotswap")
    edges = hotswap_graph().edges
    assert [f"{m} -> {t}" for m in sorted(edges) for t in sorted(edges[m] & lazy)] == []


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_reports_a_deferred_cycle(tmp_path: Path) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def load():\n    from . import a\n    return a\n",
            "c.py": "import pkg.a\n",
        },
    )
    graph = build_graph(pkg, "pkg")
    assert graph.edges == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph.edges) == ["pkg.a", "pkg.b", "pkg.a"]


def test_checker_resolves_import_forms(tmp_path: Path) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "__init__.py": "from pkg.sub.leaf import VALUE\n",
            "sub/__init__.py": "from . import leaf\n",
            "sub/leaf.py": "import ray.util\nVALUE = 1\n",
            "sub/user.py": "from ..sub import leaf as lf\nfrom .. import VALUE\nimport os\n",
        },
    )
    graph = build_graph(pkg, "pkg")
    assert graph.edges["pkg"] == {"pkg.sub.leaf"}
    assert graph.edges["pkg.sub"] == {"pkg.sub.leaf"}
    assert graph.edges["pkg.sub.user"] == {"pkg.sub.leaf", "pkg"}
    assert graph.external["pkg.sub.leaf"] == {"ray"}
    assert find_cycle(graph.edges) is None


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ({"pkg.low": 0, "pkg.high": 1}, ["pkg.low (0) -> pkg.high (1)"]),
        ({"pkg.low": 1, "pkg.high": 1}, []),
        ({"pkg": 0, "pkg.high": 1}, ["pkg.low: no layer"]),  # `pkg` covers __init__ only
    ],
)
def test_checker_reports_layer_violations(layers: dict[str, int], expected: list[str]) -> None:
    edges = {"pkg.low": {"pkg.high"}, "pkg.high": set()}
    assert layer_violations(edges, layers) == expected
