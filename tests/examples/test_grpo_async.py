"""examples/grpo_async.py: the GRPO recipe learns (the reward rises) and the engine's logprobs
equal the trainer's, in process, against `hotswap serve` over gloo, with in-flight pushes and
with its engines on Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.examples.runner import run_example, summaries


def run_grpo(*args: str) -> str:
    return run_example("grpo_async.py", *args, timeout_s=840)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pushes", [(), ("--in-flight",)], ids=["paused", "in-flight"])
def test_grpo_recipe_learns_with_the_engines_logprobs(tmp_path: Path, pushes: tuple) -> None:
    """Async (one-step-off) GRPO, fp32 engine, temperature 0.7 (so processed logprobs differ
    from raw ones): the reward rises, and on tokens sampled from the trainer's current
    weights the engine's logprobs equal the trainer's to 1e-4. --in-flight: pushes without
    pausing (kv_policy recompute), with the same guarantees."""
    log = tmp_path / "grpo.json"
    # 6 steps: the mean reward of the last two rose 0.50 to 0.63 over the first two's with
    # seeds 0 to 2 (this one runs seed 0), well above the 0.2 asked for; the same rewards
    # with --in-flight.
    run_grpo("--mode", "async", "--steps", "6", "--temperature", "0.7", *pushes,
             "--log-json", str(log))  # fmt: skip
    summary = json.loads(log.read_text())["summary"]
    assert summary["steps"] == 6
    assert summary["reward_last"] >= summary["reward_first"] + 0.2, summary
    assert summary["on_policy_tokens"] > 0
    assert summary["max_abs_dlogp"] <= 1e-4, summary


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_recipe_compare_over_http_and_gloo(tmp_path: Path) -> None:
    """`--compare` runs both modes against `hotswap serve` (weights over gloo) and plots."""
    plot = tmp_path / "compare.png"
    out = run_grpo("--compare", "--steps", "2", "--engine", "http", "--transport", "gloo",
                      "--plot", str(plot))  # fmt: skip
    assert [s["mode"] for s in summaries(out)] == ["sync", "async"]
    assert all(s["max_abs_dlogp"] <= 1e-4 for s in summaries(out))
    assert "async is" in out and plot.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_recipe_with_its_engines_on_ray(tmp_path: Path) -> None:
    """--engine ray: two engine actors on a local Ray, weights through the object store
    with a two-phase commit; the engines' logprobs still match the trainer's."""
    pytest.importorskip("ray")
    log = tmp_path / "grpo.json"
    run_grpo("--mode", "async", "--steps", "3", "--engine", "ray", "--ray-engines", "2",
             "--engine-threads", "1", "--transport", "ray", "--log-json", str(log))  # fmt: skip
    summary = json.loads(log.read_text())["summary"]
    assert (summary["steps"], summary["engine"], summary["transport"]) == (3, "ray", "ray")
    assert summary["on_policy_tokens"] > 0
    assert summary["max_abs_dlogp"] <= 1e-4, summary
