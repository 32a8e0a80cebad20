"""Engine configuration: frozen dataclasses, resolved once from user arguments."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from hotswap.errors import InvalidArgument
from hotswap.generation_config import default_sampling
from hotswap.weight_transfer.config import WeightTransferConfig

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


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
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True


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
    logprobs_mode: str = "raw_logprobs"  # vLLM's: raw_/processed_ logprobs/logits
    # Disk reloads read only files whose real path lies under one of these (real paths).
    allowed_weight_dirs: tuple[Path, ...] = ()
    # vLLM's --worker-extension-cls: "module:Class" (or "module.Class"), whose public
    # methods collective_rpc may call; named at start, never by a request.
    worker_extension_cls: str | None = None
    # vLLM's --enforce-eager: run the model eagerly instead of through torch.compile.
    enforce_eager: bool = False
    # hotswap's CPU kernels (paged decode attention, bf16 GEMV); off: torch operators only.
    cpu_kernels: bool = True
    # oneDNN-packed copies of the bf16 linear weights for batches above the GEMV's rows.
    prepack_weights: bool = True
    default_sampling: dict[str, Any] = field(default_factory=dict)  # generation_config


@dataclass
class EngineArgs:
    """The flat, user-facing knobs (Python kwargs and CLI flags share these names)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_prefill_tokens_while_decoding: int | None = None
    enable_chunked_prefill: bool = True
    batch_invariant: bool = False
    device: str = "cpu"
    # Engine cores behind one front-end (AsyncLLM multiprocess / hotswap serve); with CUDA,
    # rank i runs on the device's index + i (backend "ray": on the GPU Ray gives it).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # set per engine core by the data-parallel front-end
    # Where the engine cores run (vLLM's --data-parallel-backend): "mp", child processes
    # of the front-end; "ray", Ray actors (one placement-group bundle each; hotswap[ray]).
    data_parallel_backend: str = "mp"
    # The Ray cluster for backend "ray" ("auto", "ray://host:10001", ...); None: the one
    # this process already joined, else `ray.init()`'s (a new local one if none is found).
    ray_address: str | None = None
    # torch threads per engine core (None: torch's choice); process-wide when the engine
    # runs in this process
    num_threads: int | None = None
    enable_sleep_mode: bool = False
    # JSON text or dict, e.g. {"backend": "gloo"} (see hotswap.weight_transfer)
    weight_transfer_config: str | dict[str, Any] | None = None
    # What logprobs report (vLLM's names): raw_logprobs, raw_logits, processed_logprobs
    # (the distribution tokens are drawn from: what RL importance ratios need),
    # processed_logits.
    logprobs_mode: str = "raw_logprobs"
    # dtype of the final norm and LM head (None: dtype); "float32" for RL with a bf16 body
    lm_head_dtype: str | None = None
    # Directories a disk reload (/update_weights_from_disk, the disk backend) may read
    # from, symlinks resolved; None: the model directory's parent.
    allowed_weight_dirs: list[str] | None = None
    # A class whose public methods `collective_rpc` calls inside the engine core (vLLM's
    # --worker-extension-cls): "module:Class" or "module.Class".
    worker_extension_cls: str | None = None
    # Run the model eagerly, never through torch.compile (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # hotswap's CPU kernels (built once per machine): paged decode attention reading the
    # KV cache in place and a bf16 GEMV for single rows. False: torch operators only.
    cpu_kernels: bool = True
    # With the CPU kernels: a oneDNN-packed copy of the bf16 linear weights for batches of
    # more than 8 rows (15-25% faster GEMMs; one more copy of those weights in memory,
    # remade in the first step after each weight commit, ~0.1 s for the default model).
    prepack_weights: bool = True
    # Default sampling parameters (vLLM's flags; hotswap.generation_config)
    generation_config: str = "auto"
    override_generation_config: str | dict[str, Any] | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        model_dir = resolve_model_path(self.model)
        hf_config = read_hf_config(model_dir)
        model_cfg = ModelConfig(
            path=model_dir,
            hf_config=hf_config,
            dtype=parse_dtype(self.dtype),
            max_model_len=self._resolve_max_model_len(hf_config),
            load_format=_check_choice("load_format", self.load_format, ("auto", "dummy")),
            seed=self.seed,
            head_dtype=self._head_dtype(),
        )
        _check_positive("data_parallel_size", self.data_parallel_size)
        check_data_parallel_backend(self.data_parallel_backend, self.ray_address)
        if self.num_threads is not None:
            _check_positive("num_threads", self.num_threads)
        return EngineConfig(
            model=model_cfg,
            cache=self._cache_config(),
            scheduler=self._scheduler_config(model_cfg.max_model_len),
            batch_invariant=self.batch_invariant,
            device=check_device(self.device),
            tokenizer=Path(self.tokenizer) if self.tokenizer else model_dir,
            enable_sleep_mode=self.enable_sleep_mode,
            weight_transfer=WeightTransferConfig.parse(self.weight_transfer_config),
            data_parallel_rank=self.data_parallel_rank,
            logprobs_mode=check_logprobs_mode(self.logprobs_mode),
            allowed_weight_dirs=allowed_weight_dirs(self.allowed_weight_dirs, model_dir),
            worker_extension_cls=check_class_path(self.worker_extension_cls),
            enforce_eager=bool(self.enforce_eager),
            cpu_kernels=bool(self.cpu_kernels),
            prepack_weights=bool(self.prepack_weights),
            default_sampling=default_sampling(
                self.generation_config, model_dir, self.override_generation_config
            ),
        )

    def _head_dtype(self) -> torch.dtype | None:
        if self.lm_head_dtype is None:
            return None
        try:
            return parse_dtype(self.lm_head_dtype)
        except ValueError as e:
            message = str(e).replace("dtype:", "lm_head_dtype:", 1)
            raise InvalidArgument("lm_head_dtype", message) from None

    def _resolve_max_model_len(self, hf_config: dict[str, Any]) -> int:
        limit = int(hf_config.get("max_position_embeddings") or 2048)
        if self.max_model_len is None:
            return limit
        _check_positive("max_model_len", self.max_model_len)
        if self.max_model_len > limit:
            raise InvalidArgument(
                "max_model_len",
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})",
            )
        return self.max_model_len

    def _cache_config(self) -> CacheConfig:
        _check_positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
        _check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        _check_positive("max_num_seqs", self.max_num_seqs)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        _check_positive("max_num_batched_tokens", budget)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise InvalidArgument(
                "max_num_batched_tokens",
                f"max_num_batched_tokens: {budget} is smaller than max_model_len "
                f"({max_model_len}); without chunked prefill a prompt must fit in one step",
            )
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None:
            _check_positive("max_prefill_tokens_while_decoding", cap)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_prefill_tokens_while_decoding=cap if self.enable_chunked_prefill else None,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
        )


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


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model: {config_path} not found")
    with config_path.open() as f:
        return json.load(f)


def _check_positive(name: str, value: int) -> None:
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
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise InvalidArgument(
            "data_parallel_backend",
            "data_parallel_backend: 'ray' needs Ray, which is not installed: "
            "pip install 'hotswap[ray]'",
        )
    return backend  # type: ignore[return-value]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidArgument(name, f"{name}: must be one of {choices}, got {value!r}")
    return value
