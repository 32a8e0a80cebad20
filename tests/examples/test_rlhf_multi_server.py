"""examples/rlhf_multi_server.py runs unattended: one trainer, several rollout servers, one
commit (`hotswap.rl.EngineGroup`): every server ends on the same version."""

from __future__ import annotations

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_rlhf_multi_server_runs() -> None:
    out = run_example("rlhf_multi_server.py")
    assert "every server now has: {'weight_version': 'step-1'" in out, out[-3000:]
