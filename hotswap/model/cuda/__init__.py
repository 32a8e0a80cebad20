"""hotswap's CUDA path: Triton kernels (paged attention, the KV store, fused norms, RoPE and
SiLU-and-mul), the attention backend over them and CUDA graphs for decode steps.

The kernels are plain Triton, which ships with CUDA builds of torch: nothing to compile
ahead of time. Where no GPU is present (CI, the CPU tests) they run under Triton's
interpreter on CPU tensors, which Triton reads from `TRITON_INTERPRET=1` when it is first
imported (the test suite sets it before anything imports torch._dynamo, which imports
Triton), so every kernel is tested on every machine against its torch reference.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run for tensors on `device`: compiled for a CUDA
    device, or interpreted on the host when TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"
