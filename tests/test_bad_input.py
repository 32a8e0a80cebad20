"""Every bad input gets a clear exception that names the problem, and changes nothing.

Checkpoint problems are made by copying a real tiny model directory and rewriting its
config.json or model.safetensors; request problems run against a real engine.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, SamplingParams
from hotswap.model.models.registry import MODEL_REGISTRY

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
StateDict = dict[str, torch.Tensor]


def make_llm(model_dir: Path, **kw: Any) -> LLM:
    """A small engine: 8 blocks of 16 = 128 KV tokens, enough for max_model_len=64."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 64)
    kw.setdefault("num_kv_blocks", 8)
    return LLM(str(model_dir), progress=False, **kw)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(model_dir: Path, mutate: Callable[[StateDict], None]) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    mutate(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def token_ids(outputs: list) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def assert_engine_idle(llm: LLM) -> None:
    """Nothing was added: no request in the engine or the front end, every block free."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.requests
    assert engine.scheduler.kv.num_free_blocks == engine.runner.num_blocks
    assert not llm.processor.requests and not llm.processor.child_to_choice


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return make_llm(tiny_llama, max_model_len=32)


# -- the checkpoint ------------------------------------------------------------------------


def test_unknown_architecture_names_it_and_the_supported_ones(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MistralForCausalLM") as info:
        make_llm(model_dir)
    message = str(info.value)
    assert message.startswith("architecture")
    assert all(name in message for name in MODEL_REGISTRY)


def test_missing_architectures_key(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    del config["architectures"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        make_llm(model_dir)


@pytest.mark.parametrize(
    "missing",
    [
        "model.norm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.k_proj.weight",  # one shard of the fused qkv_proj
        "model.layers.0.mlp.up_proj.weight",  # one shard of the fused gate_up_proj
    ],
)
def test_missing_weight_names_the_checkpoint_tensor(
    tiny_llama: Path, tmp_path: Path, missing: str
) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")
    rewrite_weights(model_dir, lambda state: state.pop(missing))
    with pytest.raises(ValueError, match=re.escape(missing)) as info:
        make_llm(model_dir)
    assert "missing" in str(info.value)


@pytest.mark.parametrize(
    ("name", "bad_shape", "expected_shape"),
    [
        ("model.norm.weight", (63,), (64,)),
        ("model.layers.0.mlp.up_proj.weight", (5, 64), (128, 64)),
        ("model.layers.1.self_attn.v_proj.weight", (32, 63), (32, 64)),
    ],
)
def test_shape_mismatch_names_the_tensor_and_both_shapes(
    tiny_llama: Path,
    tmp_path: Path,
    name: str,
    bad_shape: tuple[int, ...],
    expected_shape: tuple[int, ...],
) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")

    def reshape(state: StateDict) -> None:
        assert tuple(state[name].shape) == expected_shape
        state[name] = torch.zeros(bad_shape)

    rewrite_weights(model_dir, reshape)
    with pytest.raises(ValueError, match=re.escape(name)) as info:
        make_llm(model_dir)
    message = str(info.value)
    assert str(bad_shape) in message and str(expected_shape) in message


@pytest.mark.parametrize(
    "unknown",
    [
        "model.layers.0.self_attn.extra.weight",
        "model.layers.7.input_layernorm.weight",  # a layer the model does not have
        "model.layers.7.mlp.up_proj.weight",  # ... reached through a fused shard
    ],
)
def test_unknown_tensor_names_it(tiny_llama: Path, tmp_path: Path, unknown: str) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")

    def add(state: StateDict) -> None:
        state[unknown] = torch.ones(64)

    rewrite_weights(model_dir, add)
    with pytest.raises(ValueError, match=re.escape(unknown)):
        make_llm(model_dir)


def write_sharded(src: Path, dst: Path) -> Path:
    """`src` as model.safetensors.index.json + 2 shards (the single file removed)."""
    model_dir = copy_model(src, dst)
    state = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(model_dir / file))
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return model_dir


def test_sharded_checkpoint_matches_unsharded(tiny_llama: Path, tmp_path: Path) -> None:
    sharded = write_sharded(tiny_llama, tmp_path / "sharded")
    prompts = ["The quick brown fox", "Paged attention stores"]
    expected = token_ids(make_llm(tiny_llama).generate(prompts, GREEDY, use_tqdm=False))
    got = token_ids(make_llm(sharded).generate(prompts, GREEDY, use_tqdm=False))
    assert got == expected


def test_index_listing_a_missing_shard(tiny_llama: Path, tmp_path: Path) -> None:
    sharded = write_sharded(tiny_llama, tmp_path / "sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        make_llm(sharded)


def test_model_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        make_llm(missing)


def test_model_dir_without_config(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_llm(model_dir)


def test_dir_without_weights_needs_dummy_load_format(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_llama, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        make_llm(model_dir)
    llm = make_llm(model_dir, load_format="dummy")
    [out] = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert all(0 <= t < llm.config.model.vocab_size for t in out.outputs[0].token_ids)
    assert_engine_idle(llm)


# -- the requests ---------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len") as info:
        llm.generate("The quick brown fox jumps over the lazy dog. " * 8, GREEDY, use_tqdm=False)
    assert "32" in str(info.value)
    assert_engine_idle(llm)


def test_prompt_length_boundary(llm: LLM) -> None:
    """A prompt must leave room for one generated token: 31 of 32 runs, 32 does not."""
    [out] = llm.generate([list(range(10, 41))], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(10, 42))], GREEDY, use_tqdm=False)
    assert_engine_idle(llm)


def _good_then_bad(llm: LLM, bad: Any, error: str) -> None:
    """`bad` among good prompts: the call fails, none of them ran, and the same good
    prompts then give what they give alone."""
    good = ["The quick brown fox", [30, 31, 32], {"prompt": "Paged attention"}]
    before = token_ids(llm.generate(good, GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match=error):
        llm.generate([good[0], good[1], bad, good[2]], GREEDY, use_tqdm=False)
    assert_engine_idle(llm)
    assert token_ids(llm.generate(good, GREEDY, use_tqdm=False)) == before
    assert_engine_idle(llm)


def test_too_long_prompt_among_several_runs_none(llm: LLM) -> None:
    _good_then_bad(llm, list(range(10, 50)), "max_model_len")


@pytest.mark.parametrize("bad_id", [384, 10**6, -1])
def test_token_id_outside_vocabulary(llm: LLM, bad_id: int) -> None:
    assert llm.config.model.vocab_size == 384
    with pytest.raises(ValueError, match=rf"token id {bad_id}\b.*vocabulary"):
        llm.generate([[5, bad_id, 7]], GREEDY, use_tqdm=False)
    _good_then_bad(llm, {"prompt_token_ids": [5, bad_id]}, "vocabulary")


def test_non_integer_token_id(llm: LLM) -> None:
    _good_then_bad(llm, {"prompt_token_ids": [5, 1.5]}, "token id 1.5 is outside the vocabulary")


@pytest.mark.parametrize("empty", ["", {"prompt_token_ids": []}, {"prompt": ""}])
def test_empty_prompt(llm: LLM, empty: Any) -> None:
    with pytest.raises(ValueError, match="prompt.*at least one token"):
        llm.generate([empty], GREEDY, use_tqdm=False)
    _good_then_bad(llm, empty, "at least one token")


def test_bad_prompt_type_and_params_count(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt: unsupported type float"):
        llm.generate(["ok", 1.5], GREEDY, use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sampling_params: got 1 for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert_engine_idle(llm)


# -- sampling params ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": [2, -1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(f"{field}: "), str(info.value)


def test_sampling_params_edge_values_are_accepted() -> None:
    params = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, n=1, max_tokens=1, min_tokens=1
    )
    assert params.top_k == 0 and params.greedy
    assert SamplingParams(max_tokens=None, min_tokens=100, logprobs=0, seed=0).seed == 0


# -- engine arguments -----------------------------------------------------------------------


def test_unknown_llm_kwarg_is_a_type_error(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="max_modle_len"):
        make_llm(tiny_llama, max_modle_len=32)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"dtype": torch.float16}, "dtype"),
        ({"load_format": "pt"}, "load_format"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": 1024, "num_kv_blocks": 128}, "max_model_len"),  # > 512 positions
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        # 3 blocks of 16 = 48 tokens of KV for max_model_len=64
        ({"num_kv_blocks": 3}, "num_kv_blocks"),
        # 8192 bytes = one float32 block (2 layers x K,V x 16 tokens x 2 heads x 16 dims)
        ({"num_kv_blocks": None, "kv_cache_memory_bytes": 8192}, "kv_cache_memory_bytes"),
        ({"num_kv_blocks": None, "kv_cache_memory_bytes": 100}, "kv_cache_memory_bytes"),
    ],
)
def test_bad_engine_argument_names_the_field(
    tiny_llama: Path, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError) as info:
        make_llm(tiny_llama, **kwargs)
    assert str(info.value).startswith(f"{field}: "), str(info.value)


def test_kv_cache_smaller_than_max_model_len_says_so(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"48 tokens.*max_model_len=64"):
        make_llm(tiny_llama, num_kv_blocks=3)
    make_llm(tiny_llama, num_kv_blocks=4)  # exactly 64 tokens is enough
