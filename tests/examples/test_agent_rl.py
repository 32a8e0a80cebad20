"""examples/agent_rl.py runs unattended: an agentic episode against `hotswap serve` (a
calculator tool, several turns) with a weight update between episodes."""

from __future__ import annotations

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_agent_rl_runs() -> None:
    out = run_example("agent_rl.py")
    assert "pushed weights: version 2" in out, out[-3000:]
