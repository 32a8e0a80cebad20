"""The examples run unattended and show what they claim (each is a real server or engine
plus a trainer, on the built-in model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,expected",
    [
        ("rlhf_http_gloo.py", "Paris"),
        ("rlhf_http_ipc.py", "Paris"),
        ("rlhf_async.py", "trained"),
        ("rlhf_multi_server.py", "every server now has: {'weight_version': 'step-1'"),
    ],
)
def test_example_runs(script: str, expected: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=EXAMPLES,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert expected in result.stdout, result.stdout[-3000:]
