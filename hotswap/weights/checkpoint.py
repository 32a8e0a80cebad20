"""Reading a Hugging Face checkpoint's safetensors files. A leaf module: the model loader
and the disk weight-transfer backend both read checkpoints, and the backend must not
import the loader (which imports `hotswap.config`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with index.open() as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [model_dir / name for name in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights: no *.safetensors files in {model_dir}")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"weights: {path} (listed in the index) does not exist")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def num_tensors(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return len(f.keys())
