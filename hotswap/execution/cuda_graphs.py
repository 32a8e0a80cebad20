"""CUDA graphs for decode steps: the model's forward and LM head over B single-token
sequences, captured once per batch-size bucket and replayed with the step's values copied
into static input buffers.

- Buckets: 1, 2, 4, 8, then every multiple of 8 up to the largest batch the scheduler
  runs (at most `MAX_CAPTURE`); a step of B sequences replays the smallest bucket >= B,
  its padding rows reading block 0 at context length 1 and writing no KV (slot -1: the
  store kernel skips it), so they change nothing a request owns.
- Static inputs: one int64 buffer per bucket row layout (ids, positions, slots, lengths)
  and a block table [rows, max blocks per sequence]; a step uploads its rows (and only
  the table columns its sequences use) from pinned memory, asynchronously.
- Every graph shares one memory pool. All buckets are captured when the engine starts
  (largest first), each after one eager warm-up run (which compiles the Triton kernels);
  a graph dropped later (below) is captured again on its bucket's next step.
- A graph bakes in the addresses of every weight, KV cache and buffer it read. Before each
  replay the addresses of the watched tensors (the model's parameters and buffers, the KV
  caches) are compared with those at capture; on any difference (a swapped-in weight, a
  wake from sleep, a re-allocated cache) every graph is dropped and recaptured on use, so
  a stale graph never runs. Weight writes in place keep the addresses, hence the graphs.

Capture itself goes through a `GraphCapture` (CUDA's here; the tests' stand-in records a
forward's operators on the CPU and replays them, with the same baked-in semantics).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from tqdm import tqdm

from hotswap.execution.step_inputs import StepBatch
from hotswap.model.attention import AttentionMetadata
from hotswap.model.cuda.staging import Staging

logger = logging.getLogger(__name__)

MAX_CAPTURE = 512  # vLLM's largest capture size by default
_SECTIONS = ("input_ids", "positions", "slots", "context_lens")


class GraphCapture(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """(a graph with `replay()`, the output `forward` wrote during capture)."""
        ...

    def release(self) -> None:
        """Forget the memory pool (its graphs were dropped)."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every graph in one pool."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def release(self) -> None:
        self.pool = None


def capture_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including max_rows (at most MAX_CAPTURE)."""
    limit = max(1, min(max_rows, MAX_CAPTURE))
    sizes = {1, 2, 4, limit} | set(range(8, limit, 8))
    return sorted(s for s in sizes if s <= limit)


@dataclass
class _Graph:
    graph: Any
    logits: torch.Tensor
    fingerprint: tuple[int, ...]


# The attention metadata of a decode step from its static inputs (slots, block tables,
# context lengths, positions), made inside the captured forward: the backend's
# `graph_metadata` (model/cuda/backend.py).
GraphMetadata = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         AttentionMetadata]  # fmt: skip


class DecodeGraphs:
    """Decode steps of up to `max_rows` sequences through captured graphs. `watched`
    yields the tensors whose addresses a graph depends on."""

    def __init__(
        self,
        model: nn.Module,
        capture: GraphCapture,
        watched: Callable[[], Iterable[torch.Tensor]],
        metadata: GraphMetadata,
        max_rows: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.model, self.capturer, self.watched = model, capture, watched
        self.metadata = metadata
        self.sizes = capture_sizes(max_rows)
        rows = self.sizes[-1]
        self.rows_staging = Staging(device)
        self.table_staging = Staging(device)
        self.rows = torch.zeros(len(_SECTIONS), rows, dtype=torch.int64, device=device)
        self.tables = torch.zeros(rows, max(2, max_blocks), dtype=torch.int64, device=device)
        self.graphs: dict[int, _Graph] = {}
        # Every graph writes its logits here (made by the warm-up of the first capture):
        # a graph's own output would stay allocated in the pool, one per bucket.
        self.logits: torch.Tensor | None = None
        self.graph_steps = 0  # decode steps replayed from a graph
        self.captures = 0  # graphs captured (recaptures included)
        self.recaptures = 0  # times every graph was dropped for a changed address
        self.eager_steps: Counter[str] = Counter()  # steps run eagerly, by reason

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def bucket(self, rows: int) -> int | None:
        return next((size for size in self.sizes if size >= rows), None)

    def fingerprint(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.watched())

    def capture_all(self, progress: bool = True) -> None:
        """Capture every bucket now, largest first (the smaller ones then reuse the pool's
        memory), so that no step waits for a capture: at engine start."""
        fingerprint = self.fingerprint()
        desc = "Capturing CUDA graphs for decode"
        for size in tqdm(sorted(self.sizes, reverse=True), desc=desc, disable=not progress,
                         leave=False):  # fmt: skip
            if size not in self.graphs:
                self._capture(size, fingerprint)

    def release(self) -> None:
        """Drop every graph, its pool and the output buffer (sleep; changed addresses)."""
        self.graphs.clear()
        self.logits = None
        self.capturer.release()

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step (every row single-token; rows <=
        max_rows), from its bucket's graph (captured now if need be)."""
        rows = len(batch.input_ids)
        size = self.bucket(rows)
        assert size is not None and all(n == 1 for n in batch.query_lens)
        fingerprint = self.fingerprint()
        graph = self.graphs.get(size)
        if graph is not None and graph.fingerprint != fingerprint:
            logger.debug("decode graphs: addresses changed; recapturing")
            self.release()
            self.recaptures += 1
            graph = None
        if graph is None:
            graph = self._capture(size, fingerprint)
        self._upload(batch, size)
        graph.graph.replay()
        self.graph_steps += 1
        return graph.logits[:rows]

    def _upload(self, batch: StepBatch, size: int) -> None:
        """The step's rows into the static inputs, padding rows up to the largest bucket
        (one contiguous copy), and the block table columns its sequences use."""
        pad = self.max_rows - len(batch.input_ids)
        sections = (batch.input_ids + [0] * pad, batch.positions + [0] * pad,
                    batch.slots + [-1] * pad, batch.context_lens + [1] * pad)  # fmt: skip
        self.rows_staging.upload_into([v for s in sections for v in s], self.rows)
        width = max(len(t) for t in batch.tables)
        filler = [0] * width
        tables = batch.tables + [filler] * (size - len(batch.tables))
        flat = [block for t in tables for block in t + filler[len(t) :]]
        self.table_staging.upload_into(flat, self.tables[:size, :width])

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, positions, slots, lens = (self.rows[i, :size] for i in range(len(_SECTIONS)))
        return ids, positions, slots, lens

    def _capture(self, size: int, fingerprint: tuple[int, ...]) -> _Graph:
        ids, positions, slots, lens = self._inputs(size)
        tables = self.tables[:size]
        self.rows[:, :size] = torch.tensor([[0], [0], [-1], [1]], device=self.rows.device)
        tables.zero_()

        def forward() -> torch.Tensor:
            meta = self.metadata(slots, tables, lens, positions)
            logits = self.model.compute_logits(self.model(ids, positions, meta))
            if self.logits is None:  # one output buffer for every graph
                self.logits = torch.empty((self.max_rows, logits.shape[1]), dtype=logits.dtype,
                                          device=logits.device)  # fmt: skip
            return self.logits[:size].copy_(logits)

        forward()  # warm-up: compiles the kernels, allocates nothing the graph keeps
        graph, logits = self.capturer.capture(forward)
        self.captures += 1
        captured = self.graphs[size] = _Graph(graph, logits, fingerprint)
        return captured
