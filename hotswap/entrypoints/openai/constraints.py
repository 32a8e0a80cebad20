"""What a request constrains beyond temperature and friends: vLLM's logits controls
(`logit_bias`, `allowed_token_ids`, `bad_words`) and structured outputs, from any of the
spellings clients send (`structured_outputs`, `response_format`, the removed `guided_*`),
checked here so that a bad one is a 400 naming the field the client wrote."""

from __future__ import annotations

from typing import Any

from hotswap.entrypoints.openai.protocol import SamplingRequest, StructuredOutputsRequest
from hotswap.entrypoints.server.errors import bad_request
from hotswap.errors import InvalidArgument
from hotswap.sampling_params import StructuredOutputsParams
from hotswap.structured_output import check_grammar

LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps every bias to [-100, 100]
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def logit_bias_of(body: SamplingRequest) -> dict[int, float] | None:
    """vLLM's conversion: keys are token ids written as strings, biases clamped."""
    return parse_logit_bias(body.logit_bias, "body.logit_bias")


def parse_logit_bias(
    bias: dict[str, float] | None, param: str, limit: float | None = LOGIT_BIAS_LIMIT
) -> dict[int, float] | None:
    """Token ids written as strings -> int keys (400 naming `param` otherwise); biases
    clamped to +-`limit` (None: as given, SGLang's way)."""
    if not bias:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias: found token_id {key!r} that is not an integer or a string "
                "representing an integer",
                param,
            ) from None
        parsed[token] = value if limit is None else min(limit, max(-limit, value))
    return parsed


def structured_outputs_of(body: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's one constraint, checked (400 naming its field): `response_format`
    overrides `structured_outputs` as in vLLM; `guided_*` apply when neither is given."""
    found = _from_response_format(body) or _from_structured_outputs(body) or _from_guided(body)
    if found is None:
        return None
    params, field = found
    try:
        check_grammar(params)
    except InvalidArgument as e:
        raise bad_request(str(e), field) from None
    return params


def _from_response_format(body: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    field = "body.response_format"
    base = body.structured_outputs
    options = _options(base) if base is not None else {}
    if response_format.type == "json_object":
        return _build({"json_object": True, **options}, field), field
    if response_format.type == "json_schema":
        schema = response_format.json_schema
        if schema is None:
            raise bad_request(
                "response_format: when type is 'json_schema', the 'json_schema' field must "
                "be provided",
                field,
            )
        return _build({"json": schema.json_schema or {}, **options}, field), field
    raise bad_request(
        f"response_format: type {response_format.type!r} is not supported (text, "
        "json_object, json_schema)",
        f"{field}.type",
    )


def _from_structured_outputs(body: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    request = body.structured_outputs
    if request is None:
        return None
    for name in ("structural_tag", "whitespace_pattern"):  # llguidance has no such input
        if getattr(request, name) is not None:
            raise bad_request(
                f"structured_outputs.{name}: not supported by hotswap",
                f"body.structured_outputs.{name}",
            )
    values = {
        "json": request.json_,
        "regex": request.regex,
        "choice": request.choice,
        "grammar": request.grammar,
        "json_object": request.json_object,
    }
    constraint = {name: value for name, value in values.items() if value is not None}
    kind = next(iter(constraint), None)
    field = f"body.structured_outputs.{kind}" if kind else "body.structured_outputs"
    return _build({**constraint, **_options(request)}, "body.structured_outputs"), field


def _from_guided(body: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    given = {name: getattr(body, name) for name in _GUIDED if getattr(body, name) is not None}
    if not given:
        return None
    constraint = {_GUIDED[name]: value for name, value in given.items()}
    field = f"body.{next(iter(given))}"
    return _build(constraint, field), field


def _options(request: StructuredOutputsRequest) -> dict[str, Any]:
    return {
        "disable_any_whitespace": request.disable_any_whitespace,
        "disable_additional_properties": request.disable_additional_properties,
    }


def _build(fields: dict[str, Any], field: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), field) from None
