"""A CUDA graph's stand-in on the CPU: capture records every operator a forward dispatches
(with the very tensors it used), replay runs them again in order on those tensors.

It keeps a real graph's semantics where they bite: whatever Python computed during the
forward (sizes, lists, a tensor made from host values) stays as it was at capture; each
operator's output is written into the memory it got at capture; and every input is read at
the address it had at capture: a tensor whose storage moved since (a weight swapped in, a
re-allocated KV cache) makes replay fail, as reading freed memory would on a GPU. A host
read of a device value during capture (`.item()`, `bool()`) fails the capture, as it
fails a CUDA stream capture."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default}
HOST_VALUES = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


class StaleGraphError(RuntimeError):
    pass


def _kind(func: Any) -> str:
    """'mutates' (writes an argument; may return new tensors too), 'view' (returns an
    alias of an argument) or 'fresh'."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutates"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "fresh"


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"graph capture: {func} reads a device value on the host")
        if func in HOST_VALUES:
            raise RuntimeError("graph capture: a tensor made from host values in the forward")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, _kind(func)))
        return out


class _External:
    """An input the forward did not make (a weight, a buffer, a cache, a static input):
    only its memory is held, as a graph holds an address. A view is remade from its base
    (held weakly: a freed base is freed memory)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        self.ref, self.address = weakref.ref(base), base.data_ptr()
        self.layout = (tensor.shape, tensor.stride(), tensor.storage_offset())

    def resolve(self, func: Any) -> torch.Tensor:
        base = self.ref()
        if base is None:
            raise StaleGraphError(f"graph replay: an input of {func} was freed since capture")
        if base.data_ptr() != self.address:
            raise StaleGraphError(f"graph replay: an input of {func} moved since capture")
        return base.as_strided(*self.layout)


def _resolve(value: Any, func: Any) -> Any:
    return value.resolve(func) if isinstance(value, _External) else value


class RecordedGraph:
    def __init__(self, ops: list) -> None:
        made = {id(t) for op in ops for t in tree_flatten(op[3])[0] if isinstance(t, torch.Tensor)}

        def hold(value: Any) -> Any:
            is_input = isinstance(value, torch.Tensor) and id(value) not in made
            return _External(value) if is_input else value

        self.ops = [(func, tree_map(hold, (args, kwargs)), out, kind)
                    for func, args, kwargs, out, kind in ops]  # fmt: skip
        self.replays = 0

    def replay(self) -> None:
        for func, held, out, kind in self.ops:
            args, kwargs = tree_map(functools.partial(_resolve, func=func), held)
            if kind == "view":
                continue  # its inputs are where they were: it still aliases their memory
            result = func(*args, **kwargs)
            # into the memory the capture gave its outputs (an in-place op's is its input's)
            for recorded, new in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(recorded, torch.Tensor) and recorded.data_ptr() != new.data_ptr():
                    recorded.copy_(new)
        self.replays += 1


class RecordingCapture:
    """`GraphCapture` (execution/cuda_graphs.py) on the CPU."""

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []
        self.releases = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[RecordedGraph, torch.Tensor]:
        with _Recorder() as recorder:
            out = forward()
        graph = RecordedGraph(recorder.ops)
        self.graphs.append(graph)
        return graph, out

    def release(self) -> None:
        self.releases += 1
