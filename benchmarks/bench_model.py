"""Random-weight models in Hugging Face format for the GPU benchmarks (no hub here, and none
on a lent GPU machine): the shapes of a real model, bf16 weights drawn as transformers
initialises them (std 0.02), SmolLM2's 49152-token vocabulary, a small BPE tokenizer
(the benchmarks send token ids).

    python benchmarks/bench_model.py OUT_DIR [--shape qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    # Qwen3-0.6B's body (hidden 1024, 28 layers, 16 query / 8 key-value heads of 128,
    # intermediate 3072, per-head q/k norms), SmolLM2's vocabulary, tied: 491M parameters
    "qwen3-0.6b": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
    ),  # fmt: skip
    # the same layout, small: for checking a benchmark script on a CPU
    "qwen3-tiny": dict(
        arch="Qwen3ForCausalLM",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
    ),  # fmt: skip
}


def write_bench_model(out_dir: Path, shape: str = "qwen3-0.6b") -> Path:
    """The model of `shape` in `out_dir` (kept if already there)."""
    import transformers

    from tests.helpers.tiny_models import write_tokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config = transformers.Qwen3Config(
        vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, architectures=[arch], **spec,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    args = parser.parse_args()
    path = write_bench_model(args.out_dir, args.shape)
    print(json.dumps({"model": str(path), "shape": args.shape}))


if __name__ == "__main__":
    main()
