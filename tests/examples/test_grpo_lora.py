"""examples/grpo_lora.py: GRPO training a peft LoRA adapter pushes only the adapter and learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.examples.runner import run_example


def run_grpo(*args: str) -> str:
    return run_example("grpo_lora.py", *args, timeout_s=840)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_lora_recipe_learns_pushing_only_the_adapter(tmp_path: Path) -> None:
    """GRPO training a peft LoRA adapter: only the adapter is pushed (a few MB), each push
    is the adapter's next version, the reward rises, and the engine's logprobs on tokens
    from the trainer's current adapter equal the trainer's to 1e-4."""
    log = tmp_path / "grpo_lora.json"
    # 4 steps: the adapter learns fast (lr 2e-3); step 3's reward was 0.44 to 0.75 above
    # step 0's with seeds 0 to 3 (this one runs seed 0: 0.25 -> 1.0).
    run_grpo("--steps", "4", "--log-json", str(log))
    summary = json.loads(log.read_text())["summary"]
    assert summary["steps"] == 4
    assert summary["reward_last"] >= summary["reward_first"] + 0.2, summary
    assert summary["push_mib"] < 30  # the adapter, not the model's ~540 MB
    assert summary["on_policy_tokens"] > 0
    assert summary["max_abs_dlogp"] <= 1e-4, summary
