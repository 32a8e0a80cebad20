"""Runs one scheduled step on the model: inputs from the scheduler's plan, then sampling."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from hotswap.config import EngineConfig
from hotswap.errors import InvalidArgument
from hotswap.execution.decode_paths import (
    compile_decode,
    compiled_logits,
    decode_graphs,
    graph_logits,
    watched_tensors,
)
from hotswap.execution.host_memory import return_freed_memory, reuse_freed_memory
from hotswap.execution.image_inputs import ImageInputs, text_positions
from hotswap.execution.kernel_choice import choose_kernels
from hotswap.execution.ranks import TensorParallelWorkers, on_every_rank
from hotswap.execution.routed_experts import RoutedExpertsBuffer
from hotswap.execution.sampler import Sampler, SamplingBatch, TokenLogprobs, top_logprobs
from hotswap.execution.step import ScheduledChunk, StepPlan
from hotswap.execution.step_inputs import (
    PromptLogprobRows,
    StepBatch,
    StepInputs,
    plan_batch,
    step_inputs,
)
from hotswap.lora.layers import LoRAPlan, ModelLoRA
from hotswap.model.attention import CacheSpec
from hotswap.model.cuda.staging import Staging
from hotswap.model.kv_fp8 import calculate_kv_scales_on_first_step, use_fp8_kv
from hotswap.model.loader import build_model
from hotswap.model.packed import PackedWeight, available_bytes, can_pack
from hotswap.model.parallel import TPGroup
from hotswap.model.reference import refresh_references, serving_reference
from hotswap.weights.double_buffer import RankShadow, ShadowWeights
from hotswap.weights.rank_writes import RankWeights
from hotswap.weights.residency import WeightResidency

logger = logging.getLogger(__name__)

# Prompt-logprob rows go through the LM head this many at a time (a row of fp32 logits is
# vocab * 4 bytes: 200 KB for a 49k vocabulary).
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> logprobs of the prompt tokens scored this step, in prompt order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> experts [positions, layers, top_k] of the positions from its
    # routed_experts_start on that became known this step
    routed_experts: dict[str, np.ndarray] = field(default_factory=dict)


class ModelRunner(RankWeights, RankShadow):
    """Runs the model of one engine core. Under tensor parallelism the engine core's
    runner is rank 0 and leads: it starts the other ranks (execution/ranks.py), and every
    method marked `on_every_rank` runs on all of them, in the same order (the other ranks
    only ever run what rank 0 sends them); a step's forward runs on every rank, sampling
    only here."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = True,
        groups: tuple[TPGroup, TPGroup] | None = None,
    ) -> None:
        """`groups`: on ranks 1.., their (step, transfer) channels; rank 0 makes them."""
        self.config = config
        leads = groups is None and config.tensor_parallel_size > 1
        self.workers = TensorParallelWorkers(config) if leads else None
        if self.workers is not None:
            groups = (self.workers.group, self.workers.transfer_channel)
        self.tp, self.transfer_channel = groups or (TPGroup(), TPGroup())
        self.tp.expert_parallel = config.enable_expert_parallel and self.tp.parallel
        self.rank_stage: dict[str, torch.Tensor] = {}
        self.shadow: ShadowWeights | None = None  # the double buffer's (weights/double_buffer.py)
        try:
            self._build(config, progress)
        except BaseException:
            if self.workers is not None:
                self.workers.kill()
            raise
        if self.workers is not None:
            self.workers.confirm_started()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0 only; nothing without them)."""
        if self.workers is not None:
            self.workers.stop()

    def _build(self, config: EngineConfig, progress: bool) -> None:
        self.block_size = config.cache.block_size
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            reuse_freed_memory()  # step temporaries off the page-fault path (host_memory.py)
        kernels = choose_kernels(config, self.device, progress)
        self.kernels, self.backend = kernels.cpu_kernels, kernels.backend
        self.staging = kernels.staging  # the Triton backend's input uploads
        self.model = build_model(
            config.model, self.backend, config.batch_invariant, progress, self.device, self.tp
        )
        self.model.use_kernels(kernels.layer_kernels)
        # what the KV cache holds: the model's dtype, or FP8 codes (--kv-cache-dtype fp8)
        self.cache_dtype = config.cache.cache_dtype(config.model.dtype)
        use_fp8_kv(self.model, self.cache_dtype != config.model.dtype)
        self.lora = self._attach_lora()
        self.packed: list[PackedWeight] = self._prepack() if config.prepack_weights else []
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.model.bind_kv_cache(self.kv_caches)
        self.routed_experts = self._routed_experts_buffer()
        multimodal = getattr(self.model, "multimodal", False)
        self.images = ImageInputs(self.model, self.device) if multimodal else None
        # on the bound cache, still unused
        self.compiled = compile_decode(config, self.model, self.kernels, self.tp.parallel, progress)
        self.graphs = decode_graphs(config, self.model, self.backend, self.staging,
                                    self.tp.parallel,
                                    watched_tensors(self.model, lambda: self.kv_caches),
                                    progress)  # fmt: skip
        if config.cache.scales_from_first_step:  # after the warm-ups' dummy steps
            calculate_kv_scales_on_first_step(self.model)
        # Each data-parallel rank draws its own noise for unseeded requests (the same seed
        # would make ranks sample identical "random" completions). The CPU generator keeps
        # 32 bits of a seed, so ranks are spread within them; rank 0 keeps the seed as is.
        rank_seed = (config.model.seed + 0x9E3779B1 * config.data_parallel_rank) % 2**32
        self.sampler = Sampler(rank_seed, config.logprobs_mode)
        # the sampler's per-step settings go up from pinned memory on CUDA (no host sync)
        cuda = self.device.type == "cuda"
        self.sampler_upload = Staging(self.device, torch.float64).upload if cuda else None
        self.residency = WeightResidency(self.model)

    def _attach_lora(self) -> ModelLoRA | None:
        lora = self.config.lora
        if lora is None:
            return None
        return ModelLoRA(self.model, lora.max_loras, lora.max_lora_rank,
                         self.config.batch_invariant)  # fmt: skip

    def _routed_experts_buffer(self) -> RoutedExpertsBuffer | None:
        """Experts per KV slot, with --enable-return-routed-experts on a mixture of
        experts (a dense model has none to return: its outputs carry None, as vLLM's).
        Rank 0 alone records them: every rank routes alike (the router is whole on each,
        and reads the same summed hidden states)."""
        moe = getattr(self.model, "moe", None)
        if not self.config.return_routed_experts or moe is None or self.tp.rank != 0:
            return None
        layers, sparse = self.model.spec.num_layers, sorted(moe.sparse_layers)
        slots = self.num_blocks * self.block_size
        return RoutedExpertsBuffer(slots, layers, sparse, moe.top_k, moe.num_experts, self.device)

    def _prepack(self) -> list[PackedWeight]:
        """Packed copies of the bf16 linear weights, if the fast CPU path runs and the
        copies fit in memory (half of what is available, at most): oneDNN's, and the AMX
        kernel's tiles on CPUs that have them."""
        if self.kernels is None or not can_pack():
            return []
        copies = 2 if self.kernels.amx_linear is not None else 1
        need = copies * sum(p.numel() * 2 for p in self.model.parameters()
                            if p.dtype == torch.bfloat16)  # fmt: skip
        if need > available_bytes(self.device) // 2:
            logger.warning("prepack_weights: packed copies of the weights (%.2f GiB) do not "
                           "fit in memory; GEMMs use the plain weights", need / 2**30)  # fmt: skip
            return []
        return self.model.prepack(self.kernels)  # ~0.3 s for the default model, at start

    @on_every_rank
    def weights_changed(self) -> None:
        """Drop every packed copy: the weights were (or may have been) written."""
        refresh_references(self.model)  # keep_reference: codes written as sent (after swaps)
        for holder in self.packed:
            holder.invalidate()
        if self.images is not None:
            self.images.clear()  # embeddings of the old vision tower

    # -- KV cache -------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """This rank's bytes per block (its key/value heads only), in the cache's dtype (an
        FP8 cache holds twice a bf16 one's blocks in the same memory)."""
        spec = self.model.spec
        elem = self.cache_dtype.itemsize
        kv_heads = self.model.local_heads[1]
        return 2 * spec.num_layers * self.block_size * kv_heads * spec.head_dim * elem

    def _num_blocks(self) -> int:
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        num = self.config.cache.kv_cache_memory_bytes // self.kv_bytes_per_block()
        if num < 1:
            raise InvalidArgument(
                "kv_cache_memory_bytes",
                f"kv_cache_memory_bytes: {self.config.cache.kv_cache_memory_bytes} bytes hold "
                f"no block ({self.kv_bytes_per_block()} bytes each)",
            )
        return num

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = self.model.spec
        heads, kv_heads = self.model.local_heads
        cache = CacheSpec(self.block_size, heads, kv_heads, spec.head_dim, self.cache_dtype,
                          self.device, self.config.model.dtype)  # fmt: skip
        return [self.backend.make_cache(num_blocks, cache) for _ in range(spec.num_layers)]

    @on_every_rank
    def free_kv_cache(self) -> None:
        """Release the KV memory (sleep); the scheduler must hold no block by now."""
        spec = self.model.spec
        empty = torch.empty(0, dtype=self.cache_dtype, device=self.device)
        if self.graphs is not None:
            self.graphs.release()  # their memory too; recaptured on use after the wake
        self.kv_caches = [(empty, empty)] * spec.num_layers
        self.model.bind_kv_cache(self.kv_caches)

    @on_every_rank
    def release_cached_memory(self) -> None:
        """Hand memory freed by sleep back: to the driver (PyTorch's CUDA allocator keeps
        freed blocks for reuse otherwise), or to the system (the heap keeps them, too)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            return_freed_memory()

    @on_every_rank
    def restore_kv_cache(self) -> None:
        if self.kv_caches and self.kv_caches[0][0].numel() == 0:
            self.kv_caches = self._allocate_kv_cache(self.num_blocks)
            self.model.bind_kv_cache(self.kv_caches)

    # -- weights --------------------------------------------------------------------------
    @on_every_rank
    def weights_digest(self) -> str:
        """blake2b over every parameter's name, dtype, shape and bytes, in name order (with
        tensor parallelism, over the ranks' digests in rank order)."""
        local = self._local_digest()
        if not self.tp.parallel:
            return local
        return hashlib.blake2b("|".join(self.tp.gather_objects(local)).encode(),
                               digest_size=16).hexdigest()  # fmt: skip

    def _local_digest(self) -> str:
        digest = hashlib.blake2b(digest_size=16)
        for name, param in sorted(self.model.named_parameters()):
            data = param.detach().contiguous().cpu()
            digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
            if data.numel():
                digest.update(data.view(torch.uint8).numpy())
        return digest.hexdigest()

    @on_every_rank
    def weight_checksums(self) -> list[dict[str, str]]:
        """SHA-256 of each parameter's bytes, by name; one mapping per rank, in rank order."""
        sums = {}
        for name, param in self.model.named_parameters():
            data = param.detach().contiguous().cpu().reshape(-1)
            sums[name] = hashlib.sha256(data.view(torch.uint8).numpy()).hexdigest()
        return self.tp.gather_objects(sums)

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan, reference: bool = False) -> RunnerOutput:
        """`reference`: run the model's bf16 reference weights instead of its FP8 ones
        (engine/scoring.py), eagerly (the compiled and captured steps read FP8 weights)."""
        # Decode rows first, by context length: they then form contiguous attention groups;
        # with adapters, each adapter's rows next to each other (lora/layers.py segments).
        items = sorted(plan.scheduled, key=lambda s: (s.num_tokens != 1, _adapter_key(s),
                                                      s.start))  # fmt: skip
        batch = plan_batch(items, self.block_size)
        lora = None
        if self.lora is not None:
            lora = self.lora.plan([(s.request.lora, s.num_tokens) for s in items])
        if self.tp.parallel:
            self.tp.broadcast_object(("forward_batch", (batch, lora, reference)))
        with self._adapters(lora), self._weights(reference):
            return self._run(items, batch, adapters=lora is not None, eager=reference)

    def _adapters(self, plan: LoRAPlan | None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.lora is None else self.lora.apply(plan)

    def _weights(self, reference: bool) -> contextlib.AbstractContextManager:
        return serving_reference(self.model) if reference else contextlib.nullcontext()

    def _run(self, items: list[ScheduledChunk], batch: StepBatch, adapters: bool,
             eager: bool = False) -> RunnerOutput:  # fmt: skip
        out = RunnerOutput()
        sampling = [s.request for s in items if s.samples]
        logits = None
        if not eager:
            logits = graph_logits(self.graphs, batch, adapters, self.routed_experts is not None)
        if logits is None:
            inputs = self._inputs(batch)
            # the compiled graphs were traced without adapters: adapter steps run eagerly
            logits = None if adapters or eager else self._compiled_logits(items, batch, inputs)
            if logits is not None and self.routed_experts is not None:
                self._read_routed_experts(items, inputs, out)  # the graph set them too
        if logits is None:
            hidden = self._forward(batch, inputs)
            if self.routed_experts is not None:
                self._read_routed_experts(items, inputs, out)
            if inputs.prompt_rows.rows:
                self._score_prompts(hidden, inputs.prompt_rows, out)
            if not sampling:
                return out
            logits = self.model.compute_logits(hidden[inputs.logits_rows])
        result = self.sampler(logits, SamplingBatch.from_requests(sampling, self.sampler_upload))
        for request, token, logprobs in zip(sampling, result.token_ids, result.logprobs):
            out.sampled[request.request_id] = token
            if logprobs is not None:
                out.logprobs[request.request_id] = logprobs
        return out

    def _compiled_logits(
        self, items: list[ScheduledChunk], batch: StepBatch, inputs: StepInputs
    ) -> torch.Tensor | None:
        if batch.images is not None:  # a multimodal model's step: compiled if plain RoPE
            positions = text_positions(batch.images, self.device)
            if positions is None:
                return None
            inputs = dataclasses.replace(inputs, positions=positions)
        return compiled_logits(self.compiled, items, inputs)

    def _forward(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        if batch.images is None or self.images is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        images = self.images.step(batch.images)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, images)

    def _inputs(self, batch: StepBatch) -> StepInputs:
        if self.staging is not None:  # the Triton backend: one upload
            return self.backend.step_inputs(batch, self.staging, self.block_size)
        return step_inputs(batch, self.block_size, self.config.model.dtype, self.device,
                           self.backend.reads_decode_batch)  # fmt: skip

    @torch.inference_mode()
    def forward_batch(self, batch: StepBatch, lora: LoRAPlan | None = None,
                      reference: bool = False) -> None:  # fmt: skip
        """A step on a rank other than 0: the forward and LM-head passes rank 0's `_run`
        makes for it (their collectives pair up with rank 0's), without sampling; its
        adapters as rank 0 placed them, its weights the ones rank 0 runs."""
        inputs = self._inputs(batch)
        with self._adapters(lora), self._weights(reference):
            hidden = self._forward(batch, inputs)  # images: each rank encodes its own
        rows = inputs.prompt_rows.rows
        for start in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
            chunk = torch.tensor(rows[start : start + PROMPT_LOGPROBS_CHUNK], device=self.device)
            self.model.compute_logits(hidden[chunk])
        if batch.logits_rows:
            self.model.compute_logits(hidden[inputs.logits_rows])

    def _read_routed_experts(
        self, items: list[ScheduledChunk], inputs: StepInputs, out: RunnerOutput
    ) -> None:
        """Record the step's experts at its tokens' slots, then give each request the rows
        it has not read yet (with a prefix-cache hit, the cached positions' too)."""
        buffer = self.routed_experts
        assert buffer is not None
        buffer.record(inputs.meta.slot_mapping, self.model.routed_expert_ids())
        size = self.block_size
        for item in items:
            request, end = item.request, item.start + item.num_tokens
            if end > (first := request.routed_experts_start):
                blocks = request.block_ids
                slots = [blocks[p // size] * size + p % size for p in range(first, end)]
                out.routed_experts[request.request_id] = buffer.read(slots)

    def _score_prompts(
        self, hidden: torch.Tensor, plan: PromptLogprobRows, out: RunnerOutput
    ) -> None:
        """Raw log-softmax of the rows that predict prompt tokens (vLLM's prompt logprobs),
        through the LM head in chunks; a separate pass, so sampled rows are unaffected."""
        step = PROMPT_LOGPROBS_CHUNK
        for start in range(0, len(plan.rows), step):
            rows = torch.tensor(plan.rows[start : start + step], device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            found = top_logprobs(
                logprobs, plan.targets[start : start + step], plan.ks[start : start + step]
            )
            for request_id, entry in zip(plan.request_ids[start : start + step], found):
                out.prompt_logprobs.setdefault(request_id, []).append(entry)


def _adapter_key(item: ScheduledChunk) -> int:
    lora = item.request.lora
    return -1 if lora is None else lora.uid
