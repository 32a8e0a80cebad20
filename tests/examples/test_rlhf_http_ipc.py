"""examples/rlhf_http_ipc.py runs unattended: a trainer on the same machine pushes its weights
into `hotswap serve` through named shared memory (the `ipc` backend), and the server answers
with the trained weights."""

from __future__ import annotations

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_rlhf_http_ipc_runs() -> None:
    out = run_example("rlhf_http_ipc.py")
    assert "Paris" in out, out[-3000:]
