"""A scheduled step as the model reads it: first plain lists (`StepBatch`, what rank 0
sends every tensor-parallel rank), then the tensors and attention metadata of a forward."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from hotswap.execution.step import ScheduledChunk, StepRequest
from hotswap.model.attention import build_metadata
from hotswap.multimodal.placement import PlacedImage


@dataclass
class PromptLogprobRows:
    """The rows of a step that score prompt tokens: row i predicts `targets[i]`."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


@dataclass
class StepBatch:
    """The step's tokens, in row order, and where their KV lives."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # rows sampled from, in order
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    prompt_rows: PromptLogprobRows = field(default_factory=PromptLogprobRows)
    images: ImageRows | None = None  # where a request with images is in the step


@dataclass
class ImageRows:
    """A step with image-bearing requests: every row's M-RoPE positions (one [3, n] array
    per request, in row order) and, per image placeholder run in the step, (first row,
    image, its embeddings' rows [lo, hi))."""

    rope_positions: list[np.ndarray] = field(default_factory=list)
    slices: list[tuple[int, PlacedImage, int, int]] = field(default_factory=list)

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """Every row's positions [3, rows], joined once per step (once planned)."""
        return np.ascontiguousarray(np.concatenate(self.rope_positions, axis=1))


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    meta: object
    prompt_rows: PromptLogprobRows


def plan_batch(items: list[ScheduledChunk], block_size: int) -> StepBatch:
    batch = StepBatch()
    size = block_size
    if any(item.request.images is not None for item in items):
        batch.images = ImageRows()
    for item in items:
        request, start, end = item.request, item.start, item.start + item.num_tokens
        if request.needs_prompt_logprobs:
            _plan_prompt_rows(batch.prompt_rows, request, start, end, len(batch.input_ids))
        if batch.images is not None:
            _plan_images(batch.images, request, start, end, len(batch.input_ids))
        batch.input_ids.extend(request.all_token_ids[start:end])
        batch.positions.extend(range(start, end))
        blocks = request.block_ids
        batch.slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
        if item.samples:
            batch.logits_rows.append(len(batch.input_ids) - 1)
        batch.query_lens.append(item.num_tokens)
        batch.context_lens.append(end)
        batch.tables.append(blocks[: -(-end // size)])
    return batch


def step_inputs(
    batch: StepBatch,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    reads_decode_batch: bool,
) -> StepInputs:
    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return StepInputs(
        input_ids=ids(batch.input_ids),
        positions=ids(batch.positions),
        logits_rows=ids(batch.logits_rows),
        meta=build_metadata(
            batch.query_lens,
            batch.context_lens,
            batch.tables,
            ids(batch.slots),
            block_size,
            dtype,
            reads_decode_batch,
        ),  # fmt: skip
        prompt_rows=batch.prompt_rows,
    )


def _plan_prompt_rows(
    plan: PromptLogprobRows, request: StepRequest, start: int, end: int, first_row: int
) -> None:
    """Rows of this chunk whose positions predict a prompt token not scored yet (a chunk
    recomputed after preemption skips those already scored)."""
    first = max(start, len(request.prompt_logprobs))
    last = min(end, request.num_prompt_tokens - 1)
    k = request.sampling_params.prompt_logprobs or 0
    for position in range(first, last):
        plan.rows.append(first_row + position - start)
        plan.targets.append(request.all_token_ids[position + 1])
        plan.ks.append(k)
        plan.request_ids.append(request.request_id)


def _plan_images(plan: ImageRows, request: StepRequest, start: int, end: int,
                 first_row: int) -> None:  # fmt: skip
    """Tokens [start, end)'s positions on the three axes and the image rows among them."""
    placement = request.images
    if placement is None:  # a text-only request beside image ones: equal axes
        plan.rope_positions.append(np.broadcast_to(np.arange(start, end), (3, end - start)))
        return
    plan.rope_positions.append(placement.rope_positions(start, end))
    for image in placement.overlapping(start, end):
        lo, hi = max(start, image.offset), min(end, image.end)
        plan.slices.append((first_row + lo - start, image, lo - image.offset, hi - image.offset))
