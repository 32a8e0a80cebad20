"""The Triton kernels' tests: on a GPU against CUDA tensors, elsewhere under Triton's
interpreter on CPU tensors (tests/conftest.py turns it on; skipped only where Triton is not
installed)."""

from __future__ import annotations

import pytest
import torch

from hotswap.model.cuda import triton_runs_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if not triton_runs_on(DEVICE):
    pytest.skip("Triton is not installed", allow_module_level=True)

from hotswap.model.cuda import ops  # noqa: E402 - only where Triton runs

__all__ = ["DEVICE", "ops"]
