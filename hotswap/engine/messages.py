"""Wire messages between the front-end (tokenizer, streams) and the engine core.

They are small msgspec structs, separate from the scheduler's `Request` state, so the same
messages can cross a process boundary unchanged.
"""

from __future__ import annotations

import msgspec
import numpy as np

from hotswap.engine.verbs import AnyArgs, verb_name
from hotswap.sampling_params import SamplingParams


class ImageMsg(msgspec.Struct, array_like=True):
    """One processed image of a prompt: placeholder tokens [offset, offset + length),
    its patches (float32, C order, [t * h * w, patch_dim]) and their grid."""

    offset: int
    length: int
    content_hash: str
    grid_thw: tuple[int, int, int]
    patch_dim: int
    pixels: bytes


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float | None = None
    cache_salt: str | None = None
    lora_name: str | None = None  # a loaded adapter (None: the base model)
    priority: int = 0  # --scheduling-policy priority: lower first (ignored under fcfs)
    # Routing hints for the data-parallel front end (dp_router.py); an engine core ignores
    # them: the session the request belongs to, and a rank it was pinned to.
    session_id: str | None = None
    data_parallel_rank: int | None = None
    kv_retention_s: float = 0.0  # keep its KV this long after it finishes (kv_cache.py)
    images: list[ImageMsg] | None = None  # a multimodal model's prompt images, in order


class TokenLogprobsMsg(msgspec.Struct, array_like=True):
    token_logprob: float
    token_rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class RoutedExpertsMsg(msgspec.Struct, array_like=True):
    """Rows [positions, decoder layers, top_k] of expert ids, C order, numpy dtype
    `dtype` (uint8, or uint16 beyond 256 experts, as vLLM's)."""

    data: bytes
    dtype: str
    layers: int
    top_k: int

    @classmethod
    def of(cls, rows: np.ndarray) -> RoutedExpertsMsg:
        return cls(rows.tobytes(), rows.dtype.str, rows.shape[1], rows.shape[2])

    def array(self) -> np.ndarray:
        flat = np.frombuffer(self.data, dtype=np.dtype(self.dtype))
        return flat.reshape(-1, self.layers, self.top_k)


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobsMsg] | None = None
    # Entry j scores prompt token j + 1; sent once, with the request's first token.
    prompt_logprobs: list[TokenLogprobsMsg] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Provenance of new_token_ids: the committed weights that produced them, and whether
    # they attended to KV computed with older weights (kept by pause(clear_cache=False)).
    weight_version: int = 0
    weight_label: str = "default"
    stale: bool = False
    # The LoRA adapter version the request runs on (None: the base model).
    lora_name: str | None = None
    lora_version: int | None = None
    # Experts of the positions read since the request's last output (routing replay).
    routed_experts: RoutedExpertsMsg | None = None
    # return_bf16_logprobs, on the final output: each output token's raw logprob under
    # the bf16 weights (engine/scoring.py)
    bf16_logprobs: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityCall(msgspec.Struct):
    """A control call answered by `call_id`: one declared verb's arguments (verbs.py)."""

    call_id: int
    args: AnyArgs

    @property
    def verb(self) -> str:
        return verb_name(self.args)


class CallError(msgspec.Struct, omit_defaults=True):
    """Why a call was refused, typed across the process boundary: `invalid` (the caller's
    input; `field` names the argument), `state` (not allowed in the engine's current
    state) or `internal` (the engine failed)."""

    kind: str
    message: str
    field: str | None = None


class UtilityResult(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: object = None
    error: CallError | None = None


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """One batch from the engine core. Its outputs precede its results: a call answered
    here returns only after every output produced before it has been delivered."""

    outputs: list[EngineCoreOutput] = []
    results: list[UtilityResult] = []
    engine_error: str | None = None  # the engine core died; every stream and call fails
