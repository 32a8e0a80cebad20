"""examples/rlhf_http_gloo.py runs unattended: a trainer pushes its weights into a running
`hotswap serve` over a gloo broadcast, and the server answers with the trained weights."""

from __future__ import annotations

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_rlhf_http_gloo_runs() -> None:
    out = run_example("rlhf_http_gloo.py")
    assert "Paris" in out, out[-3000:]
