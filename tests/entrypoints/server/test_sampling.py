"""The shared sampling fields (server/sampling.py): every one of them, sent to each surface
under that surface's name for it, reaches SamplingParams; null reads as the default; a
refusal names the field as the surface spells it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hotswap.entrypoints.openai.generate_params import generate_sampling_params
from hotswap.entrypoints.openai.generate_protocol import GenerateSamplingParams
from hotswap.entrypoints.openai.params import (
    EnginePrompt,
    completion_max_tokens,
    sampling_params,
)
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from hotswap.entrypoints.server.errors import APIError
from hotswap.entrypoints.server.sampling import SHARED_FIELDS, build_sampling_params
from hotswap.entrypoints.sglang.protocol import SGLANG_NAMES, SGLangSampling
from hotswap.entrypoints.sglang.request import _job
from hotswap.entrypoints.trl import generate as trl
from hotswap.entrypoints.trl.protocol import GenerateRequest, GenerationKwargs
from hotswap.errors import InvalidArgument
from hotswap.sampling_params import SamplingParams

# A valid value for every shared field, none of them SamplingParams' default: a field a
# surface drops, or reads under the wrong name, leaves the default and fails the check.
VALUES: dict[str, Any] = {
    "n": 3,
    "temperature": 0.25,
    "top_p": 0.5,
    "top_k": 7,
    "min_p": 0.125,
    "seed": 11,
    "min_tokens": 2,
    "stop": ["zz"],
    "stop_token_ids": [9],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "repetition_penalty": 1.5,
    "presence_penalty": 0.75,
    "frequency_penalty": -0.5,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "max_weight_lag": 4,
}
TRL_TOP_LEVEL = ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p")


def _openai(body: dict[str, Any]) -> SamplingParams:
    request = CompletionRequest.model_validate({"prompt": "x", **body})
    return sampling_params(request, max_tokens=5, logprobs=None, stream=False)


def _chat(body: dict[str, Any]) -> SamplingParams:
    messages = [{"role": "user", "content": "x"}]
    request = ChatCompletionRequest.model_validate({"messages": messages, **body})
    max_tokens = completion_max_tokens(request)
    return sampling_params(request, max_tokens=max_tokens, logprobs=None, stream=False)


def _vllm_generate(body: dict[str, Any]) -> SamplingParams:
    sp = GenerateSamplingParams.model_validate({**body, "max_tokens": 5})
    return generate_sampling_params(sp, stream=False, defaults={})


def _sglang(body: dict[str, Any]) -> SamplingParams:
    fields = SGLangSampling.model_validate({SGLANG_NAMES.get(k, k): v for k, v in body.items()})
    prompt = EnginePrompt("x", [1, 2])
    return _job(prompt, fields, "body.sampling_params", None, "rid", False).params


def _trl_generation_kwargs(body: dict[str, Any]) -> SamplingParams:
    return trl.sampling_params(GenerateRequest(prompts=["x"], generation_kwargs=body))


SURFACES = {
    "completions": _openai,
    "chat": _chat,
    "vllm_generate": _vllm_generate,
    "sglang": _sglang,
    "trl_generation_kwargs": _trl_generation_kwargs,
}


def test_every_shared_field_has_a_test_value() -> None:
    assert set(VALUES) == set(SHARED_FIELDS)
    assert len(SHARED_FIELDS) == len(set(SHARED_FIELDS))  # each declared once
    # TRL's generation_kwargs are the shared fields and the two its surface computes
    assert set(GenerationKwargs.model_fields) == {*SHARED_FIELDS, "max_tokens", "logprobs"}


@pytest.mark.parametrize("surface", list(SURFACES))
def test_every_shared_field_reaches_sampling_params(surface: str) -> None:
    params = SURFACES[surface](VALUES)
    reached = {name: getattr(params, name) for name in SHARED_FIELDS}
    assert reached == VALUES


def test_trl_top_level_fields_reach_sampling_params() -> None:
    body = {name: VALUES[name] for name in TRL_TOP_LEVEL}
    params = trl.sampling_params(GenerateRequest(prompts=["x"], **body))
    assert {name: getattr(params, name) for name in TRL_TOP_LEVEL} == body


def test_null_is_the_default_the_surface_gives() -> None:
    source = SimpleNamespace(temperature=None, top_k=None, stop="", seed=None)
    params = build_sampling_params(source, defaults={"temperature": 0.5})
    assert (params.temperature, params.top_k, params.stop, params.seed) == (0.5, 0, [], None)
    # `given` is taken as it is: an empty stop string there is refused
    with pytest.raises(InvalidArgument, match="stop"):
        build_sampling_params(source, stop="")


def test_a_refusal_names_the_field_as_the_surface_spells_it() -> None:
    source = SimpleNamespace(sampling_seed="x")
    with pytest.raises(InvalidArgument) as caught:
        build_sampling_params(source, names={"seed": "sampling_seed"})
    assert caught.value.field == "sampling_seed"
    assert str(caught.value).startswith("sampling_seed: must be an int")
    with pytest.raises(APIError) as refused:
        _sglang({"min_tokens": 1, "temperature": -1.0})
    assert refused.value.param == "body.sampling_params.temperature"
    assert refused.value.message.startswith("sampling_params.temperature: must be >= 0")
    with pytest.raises(APIError) as refused:
        _chat({"max_completion_tokens": 0})
    assert refused.value.param == "body.max_completion_tokens"
