"""The two fast paths a decode step may take instead of the eager forward: compiled graphs
on the CPU kernels (execution/compiled.py) and CUDA graphs on the Triton kernels
(execution/cuda_graphs.py). Each says when it applies; a step it cannot serve runs eagerly,
and the graphs count why (`DecodeGraphs.eager_steps`)."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hotswap.config import EngineConfig
from hotswap.execution.compiled import CompiledDecode, compilation_available
from hotswap.execution.step import ScheduledChunk
from hotswap.execution.step_inputs import StepBatch, StepInputs

logger = logging.getLogger(__name__)


def compile_decode(
    config: EngineConfig, model: nn.Module, cpu_kernels: Any, parallel: bool, progress: bool
) -> CompiledDecode | None:
    """Compiled graphs for decode steps of a few sequences, on the fast CPU path, unless
    eager mode is asked for or torch cannot compile here."""
    # Tensor-parallel steps run eagerly: their collectives are not in the graphs. So do
    # steps whose FP8 scales the first step computes: the graphs would keep the 1.0s.
    if (config.enforce_eager or cpu_kernels is None or parallel or not model.compilable
            or not compilation_available() or config.cache.scales_from_first_step):  # fmt: skip
        return None
    compiled = CompiledDecode(model, config.cache.block_size, config.scheduler.max_model_len)
    return compiled if compiled.warm_up(progress) else None


def compiled_logits(
    compiled: CompiledDecode | None, items: list[ScheduledChunk], inputs: StepInputs
) -> torch.Tensor | None:
    """A decode step of a few sequences through the compiled graph (every row samples);
    None: run it eagerly (not such a step, or the graph would have to recompile)."""
    if compiled is None or not CompiledDecode.applies(
        len(items), all(item.num_tokens == 1 for item in items)
    ):
        return None
    try:
        logits = compiled(inputs.input_ids, inputs.positions, inputs.meta)
    except Exception as e:  # noqa: BLE001 - a shape the graphs were not compiled for
        compiled.eager_steps += 1
        logger.debug("decode step runs eagerly: %s", e)
        return None
    compiled.compiled_steps += 1
    return logits


def decode_graphs(
    config: EngineConfig,
    model: nn.Module,
    backend: Any,
    staging: Any,
    parallel: bool,
    watched: Callable[[], Iterable[torch.Tensor]],
    progress: bool,
) -> Any:
    """CUDA graphs for decode steps on the Triton path (`staging` set), every bucket
    captured now, unless eager mode is asked for; None elsewhere."""
    device = torch.device(config.device)
    if (config.enforce_eager or staging is None or device.type != "cuda" or parallel
            or not model.graphable or config.cache.scales_from_first_step):  # fmt: skip
        return None
    from hotswap.execution.cuda_graphs import CudaGraphCapture, DecodeGraphs

    max_blocks = -(-config.scheduler.max_model_len // config.cache.block_size)
    metadata = functools.partial(backend.graph_metadata, block_size=config.cache.block_size)
    graphs = DecodeGraphs(model, CudaGraphCapture(), watched, metadata,
                          config.scheduler.max_num_seqs, max_blocks, device)  # fmt: skip
    with torch.inference_mode():  # as the steps run
        graphs.capture_all(progress)
    return graphs


def graph_logits(
    graphs: Any, batch: StepBatch, adapters: bool, routed_experts: bool
) -> torch.Tensor | None:
    """The logits of a decode step replayed from its graph, or None (and the reason
    counted) when the step runs eagerly."""
    if graphs is None:
        return None
    reason = _eager_reason(graphs, batch, adapters, routed_experts)
    if reason is not None:
        graphs.eager_steps[reason] += 1
        return None
    return graphs.run(batch)


def _eager_reason(graphs: Any, batch: StepBatch, adapters: bool, routed: bool) -> str | None:
    rows = len(batch.input_ids)
    if any(n != 1 for n in batch.query_lens):
        return "prefill"
    if rows > graphs.max_rows:
        return "batch_size"
    if adapters:
        return "lora"
    if routed:
        return "routed_experts"
    if batch.prompt_rows.rows or len(batch.logits_rows) != rows:
        return "prompt_logprobs"
    return None


def watched_tensors(model: nn.Module, kv_caches: Callable[[], list]) -> Callable[[], Iterable]:
    """What a captured graph reads by address: the model's parameters (the objects stay,
    their storage may move), its buffers but the KV caches (fixed), and the KV caches as
    the runner holds them now (re-allocated after sleep)."""
    params = list(model.parameters())
    buffers = [b for name, b in model.named_buffers() if not name.endswith(("k_cache", "v_cache"))]

    def watched() -> Iterable[torch.Tensor]:
        return itertools.chain(params, buffers, (t for pair in kv_caches() for t in pair))

    return watched
