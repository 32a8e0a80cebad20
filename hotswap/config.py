"""Engine configuration: frozen dataclasses, resolved once from user arguments."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hotswap.errors import InvalidArgument
from hotswap.quantization.fp8 import Fp8Config
from hotswap.weight_transfer.config import WeightTransferConfig

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's --attention-backend names hotswap runs (execution/kernel_choice.py): its Triton
# kernels, its CPU kernels, torch operators.
ATTENTION_BACKENDS = ("TRITON_ATTN", "CPU_ATTN", "TORCH_SDPA")
# How the data-parallel front end picks a rank for a new request (engine/dp_router.py).
DP_ROUTING = ("least-loaded", "session", "cache-aware")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
# vLLM's --kv-cache-dtype values hotswap serves: auto, the model's dtype; fp8 (= fp8_e4m3)
# and fp8_e5m2, float8 e4m3fn or e5m2 codes with one float32 scale per layer for keys and
# one for values (model/kv_fp8.py). vLLM's other values are refused, naming the field.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# The cache's codes per FP8 --kv-cache-dtype (as parse_kv_cache_dtype names them).
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def check_logprobs_mode(mode: object) -> str:
    if mode not in LOGPROBS_MODES:
        raise InvalidArgument(
            "logprobs_mode",
            f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}",
        )
    return mode  # type: ignore[return-value]


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# bf16 is the CPU default: with AMX, 64 mixed requests run 2.2x faster than in fp32 and one
# request 1.09x faster, and the KV cache holds twice the tokens (README, Benchmarks).
DEFAULT_DTYPE = "bfloat16"
DEFAULT_KV_CACHE_BYTES = 1 << 30


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidArgument(
                "dtype", f"dtype: unsupported {dtype}; choose float32 or bfloat16"
            )
        return dtype
    if dtype == "auto":
        return _DTYPES[DEFAULT_DTYPE]
    if dtype not in _DTYPES:
        raise InvalidArgument(
            "dtype", f"dtype: unsupported {dtype!r}; choose float32, bfloat16 or auto"
        )
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    hf_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"
    seed: int = 0
    # The final norm and LM head run in this dtype (None: `dtype`). float32 with a bf16
    # body keeps the logprobs an RL trainer compares against close to an fp32 trainer's.
    head_dtype: torch.dtype | None = None
    # --quantization fp8 or the checkpoint's quantization_config: FP8 linear weights
    quantization: Fp8Config | None = None

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        if not archs:
            raise ValueError(f"{self.path}/config.json: 'architectures' is missing or empty")
        return archs[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


@dataclass(frozen=True)
class MediaConfig:
    """Where a multimodal model's images may come from, and how many (vLLM's
    --limit-mm-per-prompt, --allowed-local-media-path, --allowed-media-domains). Remote
    URLs are fetched only from `allowed_media_domains` (None: never; vLLM fetches any)."""

    limit_images: int = 999
    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    # vLLM's --mm-processor-kwargs: the image processor's settings over the checkpoint's
    processor_kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8_e4m3" or "fp8_e5m2"
    # vLLM's --calculate-kv-scales: an FP8 cache's scales from the first real step's K/V,
    # kept for the engine's life (model/kv_fp8.py); nothing with an "auto" cache
    calculate_kv_scales: bool = False

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """What the KV cache's tensors hold."""
        return FP8_KV_DTYPES.get(self.kv_cache_dtype, model_dtype)

    @property
    def scales_from_first_step(self) -> bool:
        """Whether the FP8 scales are computed by the first real step (not known before)."""
        return self.calculate_kv_scales and self.kv_cache_dtype in FP8_KV_DTYPES


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # While any request is decoding, prefill (new prompts, chunks) gets at most this many
    # tokens of a step, so a burst of new prompts cannot stretch the step that running
    # requests (and a pause in keep mode) wait for. None (default): no cap beyond the
    # budget; 512 costs 5-10% throughput on 64 mixed requests here.
    max_prefill_tokens_while_decoding: int | None = None
    enable_chunked_prefill: bool = True
    max_model_len: int = 8192
    # vLLM's: "fcfs" admits in arrival order; "priority" by (priority, arrival), lower
    # first, and preempts the running request with the largest (priority, arrival) first.
    policy: str = "fcfs"


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA limits: at most `max_loras` distinct adapters in one step (each has a
    slot in every targeted layer), ranks up to `max_lora_rank`, and at most
    `max_cpu_loras` adapters loaded at once."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 8


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    batch_invariant: bool = False
    device: str = "cpu"
    tokenizer: Path | None = None
    enable_sleep_mode: bool = False
    weight_transfer: WeightTransferConfig | None = None
    data_parallel_rank: int = 0  # which engine core this is (unseeded sampling differs)
    # ranks the model is split over (model/parallel.py): rank 0 here, the others workers
    tensor_parallel_size: int = 1
    # routed experts whole on the ranks (expert parallelism) instead of split across them
    enable_expert_parallel: bool = False
    # where ranks 1.. run: "mp" worker processes, "ray" actors (hotswap.ray.ranks)
    distributed_executor_backend: str = "mp"
    logprobs_mode: str = "raw_logprobs"  # vLLM's: raw_/processed_ logprobs/logits
    # Disk reloads read only files whose real path lies under one of these (real paths).
    allowed_weight_dirs: tuple[Path, ...] = ()
    media: MediaConfig = field(default_factory=MediaConfig)
    # vLLM's --worker-extension-cls: "module:Class" (or "module.Class"), whose public
    # methods collective_rpc may call; named at start, never by a request.
    worker_extension_cls: str | None = None
    # vLLM's --enforce-eager: run the model eagerly instead of through torch.compile.
    enforce_eager: bool = False
    # hotswap's CPU kernels (paged decode attention, bf16 GEMV); off: torch operators only.
    cpu_kernels: bool = True
    # vLLM's --attention-backend (ATTENTION_BACKENDS); None: the device's default
    attention_backend: str | None = None
    # oneDNN-packed copies of the bf16 linear weights for batches above the GEMV's rows.
    prepack_weights: bool = True
    default_sampling: dict[str, Any] = field(default_factory=dict)  # generation_config
    lora: LoRAConfig | None = None  # --enable-lora
    # vLLM's --enable-return-routed-experts: each token's experts, per MoE layer
    return_routed_experts: bool = False
    bf16_logprobs: bool = False  # --enable-bf16-logprobs (engine/scoring.py)


def resolve_model_path(model: str | None) -> Path:
    """None or the default model's name selects the built-in model (converted once)."""
    from hotswap.default_model import DEFAULT_MODEL_NAME, default_model_dir

    if model is None or model in (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model: {model!r} is not a directory (hotswap loads local Hugging Face-format "
            f"checkpoints; it never downloads)"
        )
    return path


def media_config(limits: object, local_path: str | None, domains: list[str] | None,
                 processor_kwargs: object = None) -> MediaConfig:  # fmt: skip
    """vLLM's media flags: `limits` as --limit-mm-per-prompt takes it (JSON or a dict,
    {"image": N}), the local directory file:// URLs may read (real path), the domains
    remote images may come from."""
    limits = json_object("limit_mm_per_prompt", limits)
    count = limits.get("image", 999)
    if isinstance(count, dict):  # vLLM's newer form: {"image": {"count": N, ...}}
        count = count.get("count", 999)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidArgument("limit_mm_per_prompt", "limit_mm_per_prompt: expected "
                              f'{{"image": N}} with N >= 0, got {limits!r}')  # fmt: skip
    local = Path(os.path.realpath(os.path.expanduser(local_path))) if local_path else None
    kwargs = json_object("mm_processor_kwargs", processor_kwargs)
    return MediaConfig(count, local, tuple(domains) if domains is not None else None, kwargs)


def json_object(name: str, value: object) -> dict[str, Any]:
    """A flag's JSON object (text or a dict already); {} when unset."""
    if isinstance(value, str) and value:
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidArgument(name, f"{name}: not JSON ({e})") from None
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(name, f"{name}: must be a JSON object")
    return dict(value)


def allowed_weight_dirs(dirs: object, model_dir: Path) -> tuple[Path, ...]:
    """The real paths of `dirs` (one path or a list of them); None: the model's parent.
    Resolved once, at start: what a reload may read is fixed when the server starts."""
    if dirs is None:
        return (Path(os.path.realpath(model_dir)).parent,)
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    if not isinstance(dirs, (list, tuple)) or not all(
        isinstance(d, (str, os.PathLike)) and str(d) for d in dirs
    ):
        raise InvalidArgument(
            "allowed_weight_dirs",
            f"allowed_weight_dirs: must be a list of directories, got {dirs!r}",
        )
    return tuple(Path(os.path.realpath(os.path.expanduser(d))) for d in dirs)


def check_class_path(path: str | None) -> str | None:
    """ "module:Class" or "module.Class" (imported by the engine core, not here)."""
    if path is None:
        return None
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module or not name.isidentifier():
        raise ValueError(f"worker_extension_cls: expected 'module:Class', got {path!r}")
    return path


def read_hf_config(
    model_dir: Path, overrides: str | dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json, with vLLM's --hf-overrides (a JSON object) merged over its top level."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model: {config_path} not found")
    with config_path.open() as f:
        config = json.load(f)
    return {**flat_text_config(config), **json_object("hf_overrides", overrides)}


def flat_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal model's config.json nests its language model's keys (`text_config`,
    as transformers 5 writes them; older checkpoints keep them on top): they are read from
    the top level either way, top-level keys winning."""
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


QUANTIZATION_METHODS = ("fp8",)  # vLLM's --quantization values hotswap serves


def resolve_quantization(
    method: str | None, hf_config: dict[str, Any], keep_reference: bool = False
) -> Fp8Config | None:
    """vLLM's rule: the checkpoint's (or --hf-overrides') quantization_config says how its
    weights are quantized, and --quantization, when given, must agree; --quantization fp8
    alone quantizes a bf16/fp32 checkpoint on load (here blockwise, 128 x 128)."""
    declared = hf_config.get("quantization_config")
    if method is None and declared is None:
        return None
    if method is not None and method not in QUANTIZATION_METHODS:
        raise InvalidArgument("quantization", f"quantization: {method!r} is not served; choose fp8")
    return Fp8Config.from_hf(declared, keep_reference=keep_reference)


def parse_kv_cache_dtype(value: str) -> str:
    """--kv-cache-dtype, normalised: "auto", "fp8_e4m3" (fp8 is e4m3, as in vLLM) or
    "fp8_e5m2"."""
    if value not in KV_CACHE_DTYPES:
        raise InvalidArgument(
            "kv_cache_dtype",
            f"kv_cache_dtype: {value!r} is not served; choose one of {', '.join(KV_CACHE_DTYPES)}",
        )
    return "fp8_e4m3" if value == "fp8" else value


def parse_head_dtype(value: str | None) -> torch.dtype | None:
    """--lm-head-dtype (None: the model's dtype)."""
    if value is None:
        return None
    try:
        return parse_dtype(value)
    except ValueError as e:
        message = str(e).replace("dtype:", "lm_head_dtype:", 1)
        raise InvalidArgument("lm_head_dtype", message) from None


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(name, f"{name}: must be a positive integer, got {value!r}")


def check_device(value: str) -> str:
    """cpu, cuda or cuda:N, and CUDA must be there to be asked for. A bare cuda becomes
    cuda:N for the current device: PyTorch resolves a bare cuda per thread, and the engine
    allocates on several threads."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise InvalidArgument(
            "device", f"device: {value!r} is not a device; use cpu, cuda or cuda:N"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgument("device", f"device: {value!r}: only cpu and cuda are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(
                "device", f"device: {value!r}: CUDA is not available on this machine"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise InvalidArgument(
                "device",
                f"device: {value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            )
    return str(device)


DATA_PARALLEL_BACKENDS = ("mp", "ray")


def check_data_parallel_backend(backend: object, ray_address: object) -> str:
    """ "mp" or "ray", and Ray installed when it is "ray" (looked up, not imported)."""
    if backend not in DATA_PARALLEL_BACKENDS:
        raise InvalidArgument(
            "data_parallel_backend",
            f"data_parallel_backend: unknown {backend!r}; "
            f"choose from {', '.join(DATA_PARALLEL_BACKENDS)}",
        )
    if ray_address is not None and (not isinstance(ray_address, str) or not ray_address):
        raise InvalidArgument(
            "ray_address", f"ray_address: must be a cluster address, got {ray_address!r}"
        )
    if backend == "ray":
        check_ray_installed("data_parallel_backend")
    return backend  # type: ignore[return-value]


def check_ray_installed(field: str) -> None:
    """Ray looked up, not imported: the core never imports it."""
    if importlib.util.find_spec("ray") is None:
        raise InvalidArgument(
            field, f"{field}: 'ray' needs Ray, which is not installed: pip install 'hotswap[ray]'"
        )


def check_attention_backend(value: str | None) -> str | None:
    if value is None:
        return None
    name = str(value).upper()  # vLLM's enum names, any case
    return check_choice("attention_backend", name, ATTENTION_BACKENDS)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidArgument(name, f"{name}: must be one of {choices}, got {value!r}")
    return value
