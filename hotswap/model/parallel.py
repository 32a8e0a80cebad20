"""Tensor parallelism: the group of ranks one engine core runs its model on, and where a
checkpoint tensor's slice lies on each of them (vLLM's column/row/vocab-parallel layouts).

Rank 0 runs inside the engine core, ranks 1.. are worker processes (execution/ranks.py); the
group is a gloo process group on the CPU (NCCL on CUDA), built from its own TCPStore, never
the global default group (a trainer's or a broadcast backend's group may exist beside it).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hotswap.errors import InvalidArgument

# A collective waits this long for the other ranks (a rank that died fails it sooner: its
# sockets close); weight writes of large models are the longest.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallelError(RuntimeError):
    """A collective across the tensor-parallel ranks failed (a rank died or hung): the
    ranks may now hold different weights or none, so the engine must stop serving."""


@dataclass(frozen=True)
class ShardSlice:
    """The part of a checkpoint tensor one rank holds: `size` entries from `start` along
    `dim`, out of `full`."""

    dim: int
    start: int
    size: int
    full: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.size)

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def local_indices(
        self, shape: tuple[int, ...], indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Of flat `indices` into a full tensor of `shape`: which fall in this slice (a
        mask) and their flat positions in the slice (contiguous, this slice's shape)."""
        inner = 1
        for size in shape[self.dim + 1 :]:
            inner *= size
        outer, rest = indices // (self.full * inner), indices % (self.full * inner)
        along, within = rest // inner, rest % inner
        mask = (along >= self.start) & (along < self.start + self.size)
        local = (outer * self.size + (along - self.start)) * inner + within
        return mask, local[mask]


def even_split(total: int, ranks: int, rank: int, field: str) -> tuple[int, int]:
    """(start, size) of `rank`'s equal share of `total`; `field` names what must divide."""
    if total % ranks:
        raise InvalidArgument(
            "tensor_parallel_size",
            f"tensor_parallel_size: {ranks} does not divide the model's {field} ({total})",
        )
    size = total // ranks
    return rank * size, size


@dataclass(frozen=True)
class HeadLayout:
    """One rank's attention heads: query heads split evenly; key/value heads split when
    there are at least as many as ranks, else each replicated on `tp // kv_heads` ranks
    (a rank's query heads then all read the one key/value head it holds)."""

    heads: int
    kv_heads: int
    head_start: int
    kv_head_start: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, ranks: int, rank: int) -> HeadLayout:
        head_start, heads = even_split(num_heads, ranks, rank, "num_attention_heads")
        if num_kv_heads >= ranks:
            kv_start, kv_heads = even_split(num_kv_heads, ranks, rank, "num_key_value_heads")
        else:
            if ranks % num_kv_heads:
                raise InvalidArgument(
                    "tensor_parallel_size",
                    f"tensor_parallel_size: {ranks} is not a multiple of the model's "
                    f"num_key_value_heads ({num_kv_heads})",
                )
            kv_start, kv_heads = rank // (ranks // num_kv_heads), 1
        return cls(heads, kv_heads, head_start, kv_start)


class TPGroup:
    """This rank's view of its tensor-parallel group; `size == 1`: no group, every
    collective is the identity. Host tensors (and pickled objects) go over gloo; on CUDA,
    device tensors over NCCL (`device_group`)."""

    def __init__(
        self, rank: int = 0, size: int = 1, group: Any = None, device_group: Any = None
    ) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.device_group = device_group
        self.failed: str | None = None  # why a collective failed; every later one refuses
        # A mixture of experts' routed experts lie whole on the ranks, a range of them
        # each (--enable-expert-parallel), instead of every expert split over the ranks
        # (set by the runner before the model is built; model/moe.py)
        self.expert_parallel = False

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
        host = dist.ProcessGroupGloo(dist.PrefixStore("host/", store), rank, size, GROUP_TIMEOUT)
        if device.type != "cuda":
            return cls(rank, size, host)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, size, options)
        return cls(rank, size, host, nccl)

    def _for(self, tensor: torch.Tensor) -> Any:
        return self.device_group if tensor.is_cuda else self.group

    def _run(self, what: str, start: Any) -> None:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            start().wait()
        except Exception as e:  # noqa: BLE001 - any transport failure ends the group
            self.failed = (
                f"tensor parallelism: {what} across the {self.size} ranks failed "
                f"({type(e).__name__}: {e}); a rank died or hung, so the engine stops"
            )
            raise TensorParallelError(self.failed) from e

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` across the ranks, in place (row-parallel layers' partial sums)."""
        if self.parallel:
            self._run("an all-reduce", lambda: self._for(tensor).allreduce([tensor]))
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension, in rank order."""
        if not self.parallel:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run("an all-gather", lambda: self._for(tensor).allgather([parts], [tensor]))
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        if self.parallel:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._run("a broadcast", lambda: self._for(tensor).broadcast([tensor], options))
        return tensor

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable `obj`, on every rank (others pass None)."""
        if not self.parallel:
            return obj
        payload = pickle.dumps(obj) if self.rank == 0 else b""
        length = self.broadcast(torch.tensor([len(payload)], dtype=torch.int64))
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        if self.rank == 0:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return pickle.loads(self.broadcast(data).numpy().tobytes())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if not self.parallel:
            return [obj]
        payload = pickle.dumps(obj)
        lengths = self.gather_last_dim(torch.tensor([len(payload)], dtype=torch.int64))
        longest = int(lengths.max())
        data = torch.zeros(longest, dtype=torch.uint8)
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = self.gather_last_dim(data.unsqueeze(0))[0]
        return [
            pickle.loads(gathered[r * longest : r * longest + int(n)].numpy().tobytes())
            for r, n in enumerate(lengths.tolist())
        ]


def check_whole_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """ValueError unless checkpoint tensor `name` has its whole `expected` shape (of which
    a tensor-parallel rank keeps its slice)."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"weights: shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
            f"model expects {tuple(expected)}"
        )
