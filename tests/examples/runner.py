"""Running an example script as a user would: its own process, from examples/, on one torch
thread, with a time limit; what it printed, checked by the caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# One torch thread per process: an example runs a trainer and one to three engines on the
# suite's two cores, and processes of two threads each spin against one another (a
# 24-token completion then takes seconds instead of a fraction of one).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_example(script: str, *args: str, timeout_s: float = 240) -> str:
    """The script's stdout; fails the test (with the output's tail) if it exits non-zero."""
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args],
                            capture_output=True, text=True, timeout=timeout_s, cwd=EXAMPLES,
                            env=ONE_THREAD)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def summaries(stdout: str) -> list[dict]:
    """The `summary: {...}` lines a GRPO recipe prints, one per mode."""
    return [json.loads(line.removeprefix("summary: "))
            for line in stdout.splitlines() if line.startswith("summary: ")]  # fmt: skip
