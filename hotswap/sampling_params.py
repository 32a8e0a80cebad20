"""Per-request sampling options, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top-k per token, sampled or prompt


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: sampled token only)
    # top-k logprobs per prompt token (0: the prompt token only); vLLM's shape: None for the
    # first prompt token, then one dict per token. Requests asking for them skip the
    # prefix cache (a cached prefix has no logits to give).
    prompt_logprobs: int | None = None
    # vLLM's semantics: repetition over prompt + output (logit / p if > 0 else * p),
    # presence and frequency over the output (OpenAI's definition).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Abort (finish_reason "abort") instead of straddling more than this many weight
    # commits after the request's first token; None: no bound.
    max_weight_lag: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(
            _is_finite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _require(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _require(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _require(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        _require(
            self.seed is None or _is_int(self.seed), "seed", f"must be an int, got {self.seed!r}"
        )
        self._validate_lengths()
        _require(
            self.max_weight_lag is None
            or (_is_int(self.max_weight_lag) and self.max_weight_lag >= 0),
            "max_weight_lag",
            f"must be a non-negative integer, got {self.max_weight_lag!r}",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
        )
        _require(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        _require(
            _is_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
            "repetition_penalty",
            f"must be in (0, 100], got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                _is_finite(value) and -2.0 <= value <= 2.0,
                name,
                f"must be in [-2, 2], got {value!r}",
            )

    def _validate_lengths(self) -> None:
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"must be a non-negative integer, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_child(self, index: int) -> SamplingParams:
        """The params of choice `index` when n > 1: one sample each, distinct seeds."""
        seed = None if self.seed is None else self.seed + index
        # The prompt is the same for every choice: the first one scores it.
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]
