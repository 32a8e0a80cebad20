"""Per-request sampling options, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from hotswap.errors import InvalidArgument

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top-k per token, sampled or prompt


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint on what the request generates.
    `json`: a JSON schema (object or its JSON text); `regex`; `choice`: one of these
    strings; `grammar`: Lark or GBNF/EBNF text; `json_object`: any JSON object. Compiled by
    llguidance (`hotswap.structured_output`) and applied as a token mask at every step."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Objects allow only their listed properties even on a server whose
    # --structured-outputs-config backend is "guidance" (the default backend already does).
    disable_additional_properties: bool = False
    # The constraint applies once the output ends with these token ids (a reasoning
    # parser's end of thinking: as vLLM, only the answer after the thinking is
    # constrained); None or empty: from the first token.
    start_after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        _require(
            len(given) == 1,
            "structured_outputs",
            f"exactly one of {', '.join(CONSTRAINT_KINDS)} must be set, got "
            f"{', '.join(given) or 'none'}",
        )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "choice":
            _require(
                isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
                "structured_outputs.choice",
                "must be a non-empty list of strings",
            )
        elif kind in ("regex", "grammar"):
            _require(
                isinstance(value, str) and bool(value),
                f"structured_outputs.{kind}",
                "must be a non-empty string",
            )
        elif kind == "json":
            _require(
                isinstance(value, (str, dict)),
                "structured_outputs.json",
                "must be a JSON schema (an object or its JSON text)",
            )

    @property
    def kind(self) -> str:
        return next(n for n in CONSTRAINT_KINDS if getattr(self, n) not in (None, False))


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
    # vLLM's logits controls: a bias added to the logit of each token id (clamped to
    # [-100, 100] by the API, as vLLM's), the only token ids that may be sampled, and words
    # that must not be generated (their token sequences, from `resolve_bad_words`).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # With --enable-return-routed-experts: the prompt tokens whose experts are not
    # returned (vLLM's; a later turn skips the prefix an earlier one returned).
    routed_experts_prompt_start: int = 0
    # With --enable-bf16-logprobs: on the final output, each sampled token's raw logprob
    # under the unquantized (bf16) weights of an FP8 engine (issue 41; engine/scoring.py).
    return_bf16_logprobs: bool = False
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
        self._validate_returns()
        self._validate_penalties()
        self._validate_logits_controls()

    def _validate_returns(self) -> None:
        """What a request asks returned beside its tokens."""
        _require(
            _is_int(self.routed_experts_prompt_start) and self.routed_experts_prompt_start >= 0,
            "routed_experts_prompt_start",
            f"must be a non-negative integer, got {self.routed_experts_prompt_start!r}",
        )
        _require(
            isinstance(self.return_bf16_logprobs, bool),
            "return_bf16_logprobs",
            f"must be a boolean, got {self.return_bf16_logprobs!r}",
        )

    def _validate_logits_controls(self) -> None:
        bias = self.logit_bias
        _require(
            bias is None
            or (
                isinstance(bias, dict)
                and all(_is_int(t) and t >= 0 and _is_finite(v) for t, v in bias.items())
            ),
            "logit_bias",
            "must map non-negative token ids to finite numbers",
        )
        allowed = self.allowed_token_ids
        _require(
            allowed is None or (bool(allowed) and all(_is_int(t) and t >= 0 for t in allowed)),
            "allowed_token_ids",
            "must be a non-empty list of non-negative token ids",
        )
        _require(
            self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words),
            "bad_words",
            "must be non-empty strings",
        )
        _require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary (vLLM's
        check): raises InvalidArgument naming the field."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                message = f"{name}: out-of-vocabulary token ids {bad[:5]} (vocab {vocab_size})"
                raise InvalidArgument(name, message)

    def check_engine_keeps_bf16(self, enabled: bool) -> None:
        """return_bf16_logprobs needs an engine started with --enable-bf16-logprobs
        (`enabled`): InvalidArgument naming the field otherwise."""
        if self.return_bf16_logprobs and not enabled:
            raise InvalidArgument(
                "return_bf16_logprobs",
                "return_bf16_logprobs: the engine keeps no bf16 weights; start it with "
                "--enable-bf16-logprobs",
            )

    def check_prompt_length(self, prompt_len: int) -> None:
        """What depends on the prompt's length (vLLM's check and message, made whether or
        not routed experts are returned)."""
        if self.routed_experts_prompt_start > prompt_len:
            raise InvalidArgument(
                "routed_experts_prompt_start",
                f"routed_experts_prompt_start must be between 0 and the prompt length "
                f"({prompt_len}), inclusive.",
            )

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
    def has_logits_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

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


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def resolve_bad_words(params: SamplingParams, tokenizer: _Encoder) -> None:
    """vLLM's tokenization of `bad_words`: each word as it would start the text and, where
    that differs in a way that still ends on the same number of tokens, as it would follow
    a space (so that it is banned at the start and in the middle). Sets
    `bad_words_token_ids`; a no-op without bad words or when they are resolved already."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return
    sequences: list[list[int]] = []
    for word in params.bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    params.bad_words_token_ids = sequences


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(name, f"{name}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]
