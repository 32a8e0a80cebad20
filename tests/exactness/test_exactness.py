"""The exactness checker against real engines: a fixed-seed budget through the Python API
and through `hotswap serve` (fast), long budgets (slow), and planted bugs it must catch.

The fast budgets are time budgets on a fixed seed (the same schedules in the same order;
a slower machine checks fewer of them): about 12 s of Python API and 8 s of HTTP after
the server's start. Each prints its report (pytest -s shows it)."""

from __future__ import annotations

import pytest

from tests.exactness import reference, weights
from tests.exactness.generate import HTTP_SPECS
from tests.exactness.planted import PLANTS, planted
from tests.exactness.reference import Reference
from tests.exactness.runner import HTTP_RUN, Budget, Checker, run
from tests.exactness.schedule import (
    Await,
    EngineSpec,
    Pause,
    Resume,
    Round,
    Schedule,
    Submit,
)
from tests.exactness.weights import WeightBank

PROMPT = (5, 0, 17, 2, 9, 33, 101, 7, 250, 3, 77, 64, 18, 90, 23, 45, 8, 150, 31, 1)
# A request frozen mid-generation, new weights committed, resumed (clear_cache drops its KV).
SWAP_WHILE_FROZEN = Schedule(
    EngineSpec("llama", block_size=8, num_kv_blocks=64),
    (
        Submit("r0", PROMPT, max_tokens=60),  # still running when the pause lands
        Await("r0", 2),
        Pause("keep", clear_cache=True),
        Round("whole", 1),
        Resume(),
    ),
)
# A prompt cached under version 0, a commit, then a request sharing its first two blocks.
PREFIX_AFTER_A_COMMIT = Schedule(
    EngineSpec("llama", block_size=8, num_kv_blocks=64),
    (
        Submit("r0", PROMPT[:16], max_tokens=1),
        Await("r0", 1),
        Round("whole", 1),
        Submit("r1", PROMPT[:16] + (42,), max_tokens=2),
    ),
)
PLANTED_SCHEDULES = {
    "clear-cache-keeps-a-block": SWAP_WHILE_FROZEN,
    "wrong-version-label": SWAP_WHILE_FROZEN,
    "prefix-across-versions": PREFIX_AFTER_A_COMMIT,
}
# Found by the checker (seed 2): a disk reload lands mid-prefill (chunks of 8), then a
# clear_cache pause drops the KV before the first token; the routed experts of the
# prompt came partly from the chunks before the drop (some computed under the new
# weights over the old weights' KV) instead of the recompute the first token came from.
PROMPT_ROWS_AFTER_A_DROP = Schedule(
    EngineSpec("qwen3_moe", block_size=16, num_kv_blocks=32, max_num_batched_tokens=8,
               backend="sparse"),
    (
        Submit("r1", (149, 205, 117, 226, 47, 357, 287, 46, 184, 294, 225, 375, 231, 218, 317,
                      304, 212, 22, 201, 0, 225, 126, 141, 83, 355), max_tokens=1),
        Round("disk", 401),
        Pause("keep", clear_cache=True),
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def bank(tmp_path_factory: pytest.TempPathFactory) -> WeightBank:
    return WeightBank(tmp_path_factory.mktemp("exactness"))


@pytest.fixture(scope="module")
def python_checker(bank: WeightBank) -> Checker:
    return Checker(bank, "python")


def _budget_run(
    checker: Checker, seed: int, seconds: float, min_schedules: int, most: int | None = None
) -> None:
    report = run(checker, seed, Budget(seconds, most), shrink_budget_s=60.0)
    print(report.summary())
    assert report.found is None, report.summary()
    assert report.schedules >= min_schedules and report.tally.tokens > 0, report.summary()


def test_fixed_seed_budget_through_the_python_api(python_checker: Checker) -> None:
    _budget_run(python_checker, seed=0, seconds=12.0, min_schedules=8)


def test_fixed_seed_budget_through_the_http_server(bank: WeightBank) -> None:
    checker = Checker(bank, "http")
    try:
        checker.check(Schedule(HTTP_SPECS[0], ()))  # starts the first server: not budgeted
        # on that server only (the next HTTP_RUN schedules would start the second)
        _budget_run(checker, seed=0, seconds=8.0, min_schedules=1, most=HTTP_RUN)
    finally:
        checker.close()


# CI runs the slow set too: half a minute each (python -m tests.exactness runs longer)
LONG_S = 30.0
# the budget, a failure's shrinking (60 s) and a hang's deadlines: beyond pytest's 300 s
LONG_TIMEOUT_S = int(LONG_S) + 300


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_long_budget_through_the_python_api(python_checker: Checker) -> None:
    _budget_run(python_checker, seed=1, seconds=LONG_S, min_schedules=10)


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT_S)
def test_long_budget_through_the_http_server(bank: WeightBank) -> None:
    checker = Checker(bank, "http")
    try:
        _budget_run(checker, seed=1, seconds=LONG_S, min_schedules=4)  # past HTTP_RUN: 2 servers
    finally:
        checker.close()


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_bug_fails_its_schedule(python_checker: Checker, name: str) -> None:
    """The schedule passes on hotswap as it is, and fails once the bug is planted."""
    schedule = PLANTED_SCHEDULES[name]
    assert python_checker.check(schedule) == []
    with planted(name):
        failures = python_checker.check(schedule)
    assert failures and failures[0].kind in ("logprob", "token"), failures


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_bug_is_found_and_shrunk(python_checker: Checker, name: str) -> None:
    """From random schedules: found within the budget and shrunk to a few steps."""
    with planted(name):
        report = run(python_checker, seed=1, budget=Budget(120.0), shrink_budget_s=60.0)
    print(report.summary())
    assert report.found is not None, report.summary()
    assert len(report.found.shrunk.schedule.steps) <= 6, report.summary()


def test_prompt_experts_come_from_the_forward_of_the_first_token(
    python_checker: Checker,
) -> None:
    for _ in range(3):  # the reload lands mid-prefill in most runs
        assert python_checker.check(PROMPT_ROWS_AFTER_A_DROP) == []


# FP8 weights: a sparse delta mid-generation (its touched blocks requantized), then a whole
# round while the request is frozen with its KV dropped; every token against transformers
# on the dequantized weights each version names.
FP8_ROUNDS = Schedule(
    EngineSpec("llama", block_size=8, num_kv_blocks=64, backend="sparse", fp8=True),
    (
        Submit("r0", PROMPT, max_tokens=40),
        Await("r0", 3),
        Round("sparse", 5, kv_policy="recompute"),
        Await("r0", 12),
        Pause("keep", clear_cache=True),
        Round("whole", 2),
        Resume(),
    ),
)


# Found by the checker (seed 7): adapters on an FP8 model took their slots' dtype from the
# base weight (float8) instead of the activations', and the first adapter step failed.
FP8_WITH_AN_ADAPTER = Schedule(
    EngineSpec("llama", block_size=4, num_kv_blocks=128, backend="sparse", lora=True, fp8=True),
    (Submit("r0", (265,), max_tokens=4, adapter=1), Round("sparse", 3), Await("r0", 4)),
)


@pytest.mark.slow
def test_an_adapter_on_fp8_weights_is_exact(python_checker: Checker) -> None:
    assert python_checker.check(FP8_WITH_AN_ADAPTER) == []


def test_fp8_rounds_are_exact(python_checker: Checker, monkeypatch: pytest.MonkeyPatch) -> None:
    assert python_checker.check(FP8_ROUNDS) == []
    # and the check can fail: against the unquantized weights the logprobs differ
    monkeypatch.setattr(weights, "as_served", lambda state, key: state)
    failures = python_checker.check(FP8_ROUNDS)
    assert failures and failures[0].kind in ("logprob", "token"), failures


# An FP8 mixture of experts (its routed experts quantized too) over an FP8 KV cache: a
# whole round with the running request's KV recomputed, then another under a pause.
FP8_MOE_OVER_AN_FP8_CACHE = Schedule(
    EngineSpec("qwen3_moe", block_size=8, num_kv_blocks=64, fp8=True, kv_fp8=True),
    (
        Submit("r0", PROMPT, max_tokens=24),
        Await("r0", 4),
        Round("whole", 3, kv_policy="recompute"),
        Await("r0", 12),
        Pause("keep", clear_cache=True),
        Round("whole", 2),
        Resume(),
    ),
)


@pytest.mark.slow
def test_an_fp8_cache_is_checked_against_quantized_kv(
    python_checker: Checker, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert python_checker.check(FP8_MOE_OVER_AN_FP8_CACHE) == []
    # and the check can fail: a reference whose attention reads unquantized K/V
    monkeypatch.setattr(reference, "_fp8", lambda x: x)
    monkeypatch.setattr(python_checker, "reference", Reference(python_checker.reference.configs))
    failures = python_checker.check(FP8_MOE_OVER_AN_FP8_CACHE)
    assert failures and failures[0].kind in ("logprob", "token", "experts"), failures
