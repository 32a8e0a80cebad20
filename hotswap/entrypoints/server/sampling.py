"""The sampling fields every generation surface shares, declared once: their wire types
with their bounds, their names, and the one mapping from a request onto `SamplingParams`.

The surfaces (OpenAI's completions and chat, vLLM's /inference/v1/generate, SGLang's
/generate, TRL's /generate/ and /chat/) each keep their own pydantic class: the order of
its fields is the order in which pydantic reports errors (the first is the 400's), and
their defaults and null readings differ as the servers they copy differ (OpenAI: null is
the model's generation_config default; vLLM's generate: SamplingParams' defaults; SGLang:
null is the default; TRL: its client's defaults). What they share is here:

- the bounded types (`N`, `TopK`, `Seed`, `Logprobs`, `TokenCount`, `TokenIds`, `Stop`),
  checked by pydantic with its message; the value checks that SamplingParams makes
  (temperature >= 0, top_p in (0, 1], ...) are left to it, so every surface words them
  alike;
- `SHARED_FIELDS`, the SamplingParams fields a body carries as they are (under the
  surface's name for it), and `build_sampling_params`, which copies them, reads a null as
  the default, and re-spells a refusal in the surface's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from hotswap.errors import InvalidArgument
from hotswap.sampling_params import MAX_LOGPROBS, SamplingParams

I64 = 2**63
MAX_N = 1024  # samples per prompt: a bound on the work one request asks for

Int64 = Annotated[int, Field(ge=-I64, lt=I64)]
NonNegInt64 = Annotated[int, Field(ge=0, lt=I64)]

# The wire types of the shared fields (vLLM's bounds). `n` >= 1 is SamplingParams' check,
# so that its message is the same on every surface; the upper bound is pydantic's.
N = Annotated[int, Field(le=MAX_N)]
TopK = Annotated[int, Field(ge=-1, lt=2**31)]  # -1 or 0: every token
Seed = Annotated[int, Field(ge=-I64, lt=2**64)]  # vLLM takes any int64 or uint64
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
TokenCount = NonNegInt64  # max_tokens, min_tokens
TokenIds = list[NonNegInt64]  # stop_token_ids, allowed_token_ids
Stop = str | list[str]

# The SamplingParams fields that a request carries as they are, each under its own name
# unless the surface renames it (SGLang's `max_new_tokens` family). The others are the
# surface's to compute (max_tokens and logprobs above all: their null, their spelling and
# their defaults differ per surface) and are given to `build_sampling_params` by name.
SHARED_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "max_weight_lag",
)
# `"stop": ""` (or []) is no stop string, as null is, where the field is copied from the
# body (an empty string would otherwise be refused as an empty stop string).
_EMPTY_IS_DEFAULT = frozenset({"stop"})
_ABSENT = object()


def build_sampling_params(
    source: object,
    *,
    names: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    **given: Any,
) -> SamplingParams:
    """The SamplingParams of one request: each of `SHARED_FIELDS` read from `source` (a
    validated body) as attribute `names.get(field, field)`, then `given` (the fields the
    surface computes) over them. A field `source` does not declare keeps SamplingParams'
    default; a null one takes `defaults[field]` (the model's generation_config, on the
    OpenAI routes) or else SamplingParams' default. SamplingParams validates: its
    InvalidArgument comes back with the field, and the message, in the wire's name."""
    names = names or {}
    defaults = defaults or {}
    values: dict[str, Any] = {}
    for field in SHARED_FIELDS:
        value = getattr(source, names.get(field, field), _ABSENT)
        if value is None or (field in _EMPTY_IS_DEFAULT and value in ("", [])):
            value = defaults.get(field, _ABSENT)
        if value is not _ABSENT:
            values[field] = value
    values.update(given)
    try:
        return SamplingParams(**values)
    except InvalidArgument as e:
        raise wire_error(e, names) from None


def wire_error(error: InvalidArgument, names: Mapping[str, str]) -> InvalidArgument:
    """`error` with its field, and the field's first mention in the message, renamed to
    the wire's name (`max_tokens` -> SGLang's `max_new_tokens`)."""
    field = error.field
    wire = names.get(field, field) if field else field
    if not field or wire == field:
        return error
    return InvalidArgument(wire, str(error).replace(field, wire, 1))
