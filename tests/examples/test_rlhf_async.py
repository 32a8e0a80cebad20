"""examples/rlhf_async.py runs unattended: weights swapped in the middle of streaming rollouts,
in process, each token attributed to the weights that produced it."""

from __future__ import annotations

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_rlhf_async_runs() -> None:
    out = run_example("rlhf_async.py")
    assert "trained" in out, out[-3000:]
