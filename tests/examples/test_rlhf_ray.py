"""examples/rlhf_ray.py runs unattended: one trainer actor, two engine actors, one commit on a
local Ray."""

from __future__ import annotations

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_rlhf_ray_runs() -> None:
    out = run_example("rlhf_ray.py")
    assert "(trained weights): 'The capital of France is' -> ' Paris" in out, out[-3000:]
