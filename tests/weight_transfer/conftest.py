from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trainer_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The trainer's copy of a checkpoint: a transformers model (checkpoint names)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@pytest.fixture(scope="session")
def v1_trainer(v1_dir: Path) -> torch.nn.Module:
    return trainer_model(v1_dir)


@pytest.fixture(scope="session")
def v2_trainer(v2_dir: Path) -> torch.nn.Module:
    return trainer_model(v2_dir)
