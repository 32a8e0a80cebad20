"""examples/rlhf_tp.py: an FSDP2 trainer of 2 ranks pushes its shards into a 3-rank engine
over m2n; the pushed weights answer the model's " Paris", and after an optimizer step the
engine's logprobs of the target equal the trainer's."""

from __future__ import annotations

import re

import pytest

from tests.examples.runner import run_example


@pytest.mark.slow
def test_a_sharded_trainer_updates_a_tensor_parallel_engine() -> None:
    out = run_example("rlhf_tp.py", timeout_s=300)
    assert "trained weights: 'The capital of France is' -> ' Paris" in out, out[-3000:]
    assert "pushed 'step-1': version 2" in out, out[-3000:]
    diff = float(re.search(r"max \|diff\| (\S+)", out).group(1))
    assert diff < 1e-4, out[-3000:]
