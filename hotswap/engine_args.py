"""`EngineArgs`: the flat, user-facing engine knobs, declared once. Python keyword
arguments (`LLM(model, **kwargs)`), the CLI flags of `hotswap serve` / `generate` and their
help all derive from these fields: a field's `Flag` metadata holds its help, choices and
aliases (vLLM's spellings). hotswap/entrypoints/flags.py derives the parser from it, as it
does the server's flags from `ServerConfig`'s fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hotswap.config import (
    ATTENTION_BACKENDS,
    DEFAULT_KV_CACHE_BYTES,
    DP_ROUTING,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    allowed_weight_dirs,
    check_attention_backend,
    check_choice,
    check_class_path,
    check_data_parallel_backend,
    check_device,
    check_logprobs_mode,
    check_positive,
    check_ray_installed,
    media_config,
    parse_dtype,
    parse_head_dtype,
    parse_kv_cache_dtype,
    read_hf_config,
    resolve_model_path,
    resolve_quantization,
)
from hotswap.errors import InvalidArgument
from hotswap.flag_spec import arg
from hotswap.generation_config import default_sampling
from hotswap.weight_transfer.config import ENGINE_BACKENDS, WeightTransferConfig

# vLLM's --distributed-executor-backend values hotswap runs (its "external_launcher", where
# the user starts every rank, is not one): mp and ray start ranks 1..; uni runs one rank.
EXECUTOR_BACKENDS = ("mp", "ray", "uni")


@dataclass(frozen=True)
class EngineArgs:
    """The flat, user-facing knobs (Python kwargs and CLI flags share these names)."""

    model: str | None = arg(
        None, "Hugging Face-format model directory (default: built-in SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model's)")
    dtype: str = arg(
        "auto", "auto = bfloat16 (fastest on AMX CPUs)", choices=("auto", "bfloat16", "float32")
    )
    load_format: str = arg(
        "auto", "auto: the checkpoint's weights; dummy: random ones", choices=("auto", "dummy")
    )
    device: str = arg("cpu", "cpu, cuda or cuda:N")
    quantization: str | None = arg(None, "fp8: FP8 e4m3 linear weights, per-block scales "
                                   "(vLLM's flag); bf16 weights quantized on load and receipt",
                                   choices=QUANTIZATION_METHODS, aliases=("-q",))  # fmt: skip
    hf_overrides: str | dict[str, Any] | None = arg(
        None, "JSON object over the model's config.json (vLLM's flag)", metavar="JSON")  # fmt: skip
    # With CUDA, rank i runs on the device's index + i (backend "ray": on the GPU Ray gives).
    data_parallel_size: int = arg(
        1, "engine cores behind one server (requests balanced, control calls fanned out)"
    )
    # Set per engine core by the data-parallel front-end, never by a user: no flag.
    data_parallel_rank: int = 0
    tensor_parallel_size: int = arg(
        1,
        "ranks each engine core's model is split over (vLLM's flag): rank 0 in the engine "
        "core, the others in worker processes, one gloo group (NCCL on CUDA)",
        aliases=("-tp",),
    )
    enable_expert_parallel: bool = arg(
        False,
        "with --tensor-parallel-size N, place a mixture of experts' routed experts whole on "
        "the ranks (each rank 1/N of the experts) instead of splitting every expert over "
        "them (vLLM's flag); no effect on dense models or one rank",
        aliases=("-ep",),
    )
    distributed_executor_backend: str | None = arg(
        None,
        "where ranks 1.. of --tensor-parallel-size run (vLLM's flag): mp, worker processes; "
        "ray, Ray actors in the engine core's placement group; uni, no workers (one rank). "
        "Default: ray with --data-parallel-backend ray, else mp",
        choices=EXECUTOR_BACKENDS,
    )
    data_parallel_backend: str = arg(
        "mp",
        "where the engine cores run: mp, child processes; ray, Ray actors (one "
        "placement-group bundle each; pip install 'hotswap[ray]')",
        choices=("mp", "ray"),
    )
    dp_routing: str = arg(
        "session",
        "which data-parallel rank a request goes to: session (a request with X-Session-ID "
        "to its session's rank), cache-aware (also: without one, to the rank caching its "
        "prefix), least-loaded",
        choices=DP_ROUTING,
    )
    ray_address: str | None = arg(
        None,
        "Ray cluster for --data-parallel-backend ray ('auto', 'ray://host:10001'; "
        "default: ray.init()'s, a new local one if none is running)",
        metavar="ADDRESS",
    )
    # Process-wide when the engine runs in this process.
    num_threads: int | None = arg(None, "torch threads per engine core (default: torch's)")
    seed: int = arg(0, "random seed of the engine's sampling")
    max_model_len: int | None = arg(
        None, "longest prompt + output in tokens (default: the model's max_position_embeddings)"
    )
    block_size: int = arg(16, "tokens per KV cache block")
    num_kv_blocks: int | None = arg(
        None, "KV cache size in blocks (overrides --kv-cache-memory-bytes)"
    )
    kv_cache_memory_bytes: int = arg(
        DEFAULT_KV_CACHE_BYTES, "KV cache budget in bytes", aliases=("--kv-cache-memory",)
    )
    kv_cache_dtype: str = arg("auto", "auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2: FP8 "
                              "codes, one k and one v scale per layer (vLLM's flag)",
                              choices=KV_CACHE_DTYPES)  # fmt: skip
    calculate_kv_scales: bool = arg(False, "FP8 cache: k/v scales = max|K|/200, max|V|/100 of the "
                                    "first step, kept for the engine's life, weight rounds "
                                    "included (vLLM's flag; nothing with auto)")  # fmt: skip
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = arg(True, "split long prompts over several steps")
    max_num_seqs: int = arg(128, "most requests running in one step")
    scheduling_policy: str = arg(
        "fcfs", "fcfs: arrival order; priority: lower priority first", choices=SCHEDULING_POLICIES
    )
    max_num_batched_tokens: int | None = arg(
        None, "most tokens in one step (default: 2048, or max-model-len without chunking)"
    )
    max_prefill_tokens_while_decoding: int | None = arg(
        None, "cap on prefill tokens in a step while requests decode (bounds step time)"
    )
    batch_invariant: bool = arg(False, "bitwise-identical logits whatever the batch (slower)")
    enforce_eager: bool = arg(
        False, "run the model eagerly, never through torch.compile (vLLM's flag)"
    )
    cpu_kernels: bool = arg(
        True,
        "hotswap's CPU kernels (paged decode attention, bf16 GEMV; built once per "
        "machine); --no-cpu-kernels runs on torch operators only",
    )
    attention_backend: str | None = arg(
        None,
        "vLLM's flag: TRITON_ATTN, hotswap's Triton kernels (the default on CUDA); "
        "CPU_ATTN, its CPU kernels (the default on the CPU); TORCH_SDPA, torch operators",
        choices=ATTENTION_BACKENDS,
    )
    # A packed copy costs one more copy of those weights in memory, remade in the first
    # step after each weight commit (~0.1 s for the default model); 15-25% faster GEMMs.
    prepack_weights: bool = arg(
        True,
        "with the CPU kernels, keep a oneDNN-packed copy of the bf16 linear weights "
        "for larger batches (faster GEMMs; one more copy of them in memory)",
    )
    # JSON text or (from Python) a dict; see hotswap.weight_transfer.
    weight_transfer_config: str | dict[str, Any] | None = arg(
        None,
        'weight transfer backend, e.g. \'{"backend": "gloo"}\' (gloo, nccl, ipc, disk)',
        metavar="JSON",
    )
    generation_config: str = arg(
        "auto",
        "default sampling parameters: auto, the model's generation_config.json; vllm, "
        "the neutral ones; or a directory holding a generation_config.json (vLLM's flag)",
        metavar="auto|vllm|DIR",
    )
    override_generation_config: str | dict[str, Any] | None = arg(
        None, "default sampling parameters on top, e.g. '{\"temperature\": 0.2}'", metavar="JSON"
    )
    logprobs_mode: str = arg(
        "raw_logprobs",
        "what logprobs report; processed_logprobs: the distribution tokens are drawn "
        "from (after penalties, temperature, top-k/top-p/min-p), as RL trainers need",
        choices=LOGPROBS_MODES,
    )
    lm_head_dtype: str | None = arg(
        None,
        "dtype of the final norm and LM head (default: --dtype); float32 with a "
        "bf16 body brings logprobs close to an fp32 trainer's",
        choices=("float32", "bfloat16"),
    )
    allowed_weight_dirs: list[str] | None = arg(
        None,
        "directories disk reloads (/update_weights_from_disk, the disk backend) may "
        "read from, symlinks resolved (default: the model directory's parent)",
        metavar="DIR",
    )
    # vLLM's media flags (config.py media_config): a multimodal model's images
    limit_mm_per_prompt: str | dict[str, Any] | None = arg(
        None, 'most images per prompt, as JSON: {"image": N} (default 999)', metavar="JSON"
    )
    allowed_local_media_path: str | None = arg(
        None, "a directory file:// image URLs may be read from (default: none)", metavar="DIR"
    )
    allowed_media_domains: list[str] | None = arg(
        None, "domains http(s) image URLs may be fetched from (default: none)", metavar="HOST"
    )
    enable_sleep_mode: bool = arg(
        False, "allow /sleep: offload or drop weights and free the KV cache"
    )
    enable_lora: bool = arg(
        False,
        "serve LoRA adapters (loaded by /v1/load_lora_adapter, "
        "--lora-modules or a LoRARequest) beside the base model",
    )
    max_loras: int = arg(1, "most distinct LoRA adapters in one step")
    max_lora_rank: int = arg(16, "highest LoRA rank an adapter may have")
    # vLLM needs it (and is_3d_lora_weight on the request) for peft's 3-D adapters on a
    # mixture of experts' stacked experts; hotswap reads each adapter's layout itself
    enable_mixed_moe_lora_format: bool = arg(
        False, "vLLM's flag for fused 3-D MoE adapters: accepted, not needed (hotswap "
        "reads each adapter's layout, per-expert or peft's target_parameters, itself)"
    )  # fmt: skip
    max_cpu_loras: int | None = arg(
        None, "most LoRA adapters loaded at once (default: max(8, --max-loras))"
    )
    enable_return_routed_experts: bool = arg(
        False,
        "return the experts a mixture-of-experts model routed each token to "
        "(routed_experts on completions and chat; rollout routing replay)",
    )
    enable_bf16_logprobs: bool = arg(False, "keep bf16 copies of FP8 weights and let requests "
                                     "ask return_bf16_logprobs (the FP8-bf16 gap)")  # fmt: skip
    # Imported by the engine core at start, never named by a request.
    worker_extension_cls: str | None = arg(
        None,
        "a class whose public methods /collective_rpc may call inside the engine "
        "(vLLM's flag; 'module.Class' also accepted)",
        metavar="MODULE:CLASS",
    )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        model_dir = resolve_model_path(self.model)
        hf_config = read_hf_config(model_dir, self.hf_overrides)
        fp8 = resolve_quantization(self.quantization, hf_config, self.enable_bf16_logprobs)
        model_cfg = ModelConfig(
            path=model_dir,
            hf_config=hf_config,
            dtype=parse_dtype(self.dtype),
            max_model_len=self._resolve_max_model_len(hf_config),
            load_format=check_choice("load_format", self.load_format, ("auto", "dummy")),
            seed=self.seed,
            head_dtype=parse_head_dtype(self.lm_head_dtype),
            quantization=fp8,
        )
        check_positive("data_parallel_size", self.data_parallel_size)
        check_choice("dp_routing", self.dp_routing, DP_ROUTING)
        self._check_tensor_parallel()
        check_data_parallel_backend(self.data_parallel_backend, self.ray_address)
        if self.num_threads is not None:
            check_positive("num_threads", self.num_threads)
        return EngineConfig(
            model=model_cfg,
            cache=self._cache_config(),
            scheduler=self._scheduler_config(model_cfg.max_model_len),
            batch_invariant=self.batch_invariant,
            device=check_device(self.device),
            tokenizer=Path(self.tokenizer) if self.tokenizer else model_dir,
            enable_sleep_mode=self.enable_sleep_mode,
            weight_transfer=self._weight_transfer_config(),
            data_parallel_rank=self.data_parallel_rank,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=bool(self.enable_expert_parallel),
            distributed_executor_backend=self._executor_backend(),
            logprobs_mode=check_logprobs_mode(self.logprobs_mode),
            allowed_weight_dirs=allowed_weight_dirs(self.allowed_weight_dirs, model_dir),
            media=media_config(
                self.limit_mm_per_prompt, self.allowed_local_media_path, self.allowed_media_domains
            ),  # fmt: skip
            worker_extension_cls=check_class_path(self.worker_extension_cls),
            enforce_eager=bool(self.enforce_eager),
            cpu_kernels=bool(self.cpu_kernels),
            attention_backend=check_attention_backend(self.attention_backend),
            prepack_weights=bool(self.prepack_weights),
            default_sampling=default_sampling(
                self.generation_config, model_dir, self.override_generation_config
            ),
            lora=self._lora_config(),
            return_routed_experts=bool(self.enable_return_routed_experts),
            bf16_logprobs=bool(self.enable_bf16_logprobs),
        )

    def _weight_transfer_config(self) -> WeightTransferConfig | None:
        config = WeightTransferConfig.parse(self.weight_transfer_config)
        if config is None or not config.double_buffer:
            return config
        backend = ENGINE_BACKENDS.get(config.backend)  # unknown: refused at the engine's start
        if config.double_buffer and backend is not None and backend.every_rank_receives:
            # every rank receives its own parts into its stage, written at the commit
            raise InvalidArgument(
                "weight_transfer_config.double_buffer",
                f"weight_transfer_config.double_buffer: not supported with the "
                f"{config.backend!r} backend (each rank stages its own parts and writes "
                f"them at the commit)",
            )
        return config

    def _executor_backend(self) -> str:
        """vLLM's rule: the data-parallel backend's unless set; Ray checked as for DP."""
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "ray" if self.data_parallel_backend == "ray" else "mp"
        backend = check_choice("distributed_executor_backend", backend, EXECUTOR_BACKENDS)
        if backend == "ray" and self.tensor_parallel_size > 1:
            check_ray_installed("distributed_executor_backend")
        return "mp" if backend == "uni" else backend

    def _check_tensor_parallel(self) -> None:
        """What does not run tensor-parallel yet is refused here, naming its flag."""
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size == 1:
            return
        if self.distributed_executor_backend == "uni":
            name = "distributed_executor_backend"
            raise InvalidArgument(name, f"{name}: 'uni' runs one rank (got tensor_parallel_size="
                                  f"{self.tensor_parallel_size}); use mp or ray")  # fmt: skip

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        check_positive("max_loras", self.max_loras)
        check_positive("max_lora_rank", self.max_lora_rank)
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else max(8, self.max_loras)
        check_positive("max_cpu_loras", cpu)
        if cpu < self.max_loras:
            raise InvalidArgument("max_cpu_loras", f"max_cpu_loras: {cpu} is smaller than "
                                  f"max_loras ({self.max_loras})")  # fmt: skip
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu)

    def _resolve_max_model_len(self, hf_config: dict[str, Any]) -> int:
        limit = int(hf_config.get("max_position_embeddings") or 2048)
        if self.max_model_len is None:
            return limit
        check_positive("max_model_len", self.max_model_len)
        if self.max_model_len > limit:
            raise InvalidArgument(
                "max_model_len",
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})",
            )
        return self.max_model_len

    def _cache_config(self) -> CacheConfig:
        check_positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            check_positive("num_kv_blocks", self.num_kv_blocks)
        check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=parse_kv_cache_dtype(self.kv_cache_dtype),
            calculate_kv_scales=bool(self.calculate_kv_scales),
        )

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        check_positive("max_num_seqs", self.max_num_seqs)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        check_positive("max_num_batched_tokens", budget)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise InvalidArgument(
                "max_num_batched_tokens",
                f"max_num_batched_tokens: {budget} is smaller than max_model_len "
                f"({max_model_len}); without chunked prefill a prompt must fit in one step",
            )
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None:
            check_positive("max_prefill_tokens_while_decoding", cap)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_prefill_tokens_while_decoding=cap if self.enable_chunked_prefill else None,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
            policy=check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES),
        )
