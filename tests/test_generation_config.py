"""Default sampling parameters from generation_config.json (vLLM's --generation-config and
--override-generation-config): read, overridden, and used only where a request is silent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hotswap import LLM, SamplingParams
from hotswap.entrypoints.openai.params import sampling_params
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest
from hotswap.generation_config import default_sampling


def write_config(directory: Path, **values) -> Path:  # noqa: ANN003
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return directory


def test_sources_and_override(tmp_path: Path) -> None:
    model = write_config(tmp_path / "model", temperature=0.6, top_p=0.95, max_new_tokens=32)
    other = write_config(tmp_path / "other", top_k=20, do_sample=True)
    assert default_sampling("auto", model) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 32}
    assert default_sampling("vllm", model) == {}
    assert default_sampling(str(other), model) == {"top_k": 20}
    override = '{"temperature": 0.1, "repetition_penalty": 1.1}'
    assert default_sampling("auto", model, override) == {
        "temperature": 0.1, "top_p": 0.95, "repetition_penalty": 1.1, "max_tokens": 32,
    }  # fmt: skip
    assert default_sampling("auto", tmp_path) == {}  # no generation_config.json there
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling(str(tmp_path / "missing"), model)
    with pytest.raises(ValueError, match="override_generation_config"):
        default_sampling("auto", model, "{oops")


def test_request_values_win_over_defaults() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 7}
    silent = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = sampling_params(
        silent, max_tokens=None, logprobs=None, stream=False, defaults=defaults
    )
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 7)
    loud = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], temperature=1.0, top_p=0.5
    )
    params = sampling_params(loud, max_tokens=3, logprobs=None, stream=False, defaults=defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.5, 3)


def test_llm_uses_the_models_defaults_when_given_no_params(tiny_llama, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    write_config(model, temperature=0.0, max_new_tokens=5)
    prompt = list(range(10, 20))
    llm = LLM(str(model), dtype="float32", progress=False)
    (silent,) = llm.generate([prompt], use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    (explicit,) = llm.generate([prompt], greedy, use_tqdm=False)
    assert silent.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert len(silent.outputs[0].token_ids) <= 5
    neutral = LLM(str(model), dtype="float32", progress=False, generation_config="vllm")
    assert neutral.config.default_sampling == {}
