"""The checker's parts without an engine: schedules round-trip through JSON, the shrinker
finds the steps a failure needs, and the check catches forged outputs (a logprob off by
more than the tolerance, a non-argmax greedy token, a wrong version label, a wrong
expert), so none of its checks passes vacuously."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tests.exactness.check import Context, Failure, Observed, Span, Tally, check_choice
from tests.exactness.generate import random_schedule
from tests.exactness.reference import Reference
from tests.exactness.schedule import Await, Round, Schedule, Submit
from tests.exactness.shrink import shrink
from tests.exactness.weights import Ledger, WeightBank

PROMPT = (5, 0, 17, 2, 9, 33, 101, 7, 2, 250)


@pytest.mark.parametrize("transport", ["python", "http"])
def test_schedules_round_trip_through_json(transport: str) -> None:
    rng = random.Random(7)
    for _ in range(50):
        schedule = random_schedule(rng, transport)
        assert Schedule.from_json(schedule.to_json()) == schedule


def test_shrinking_keeps_only_what_the_failure_needs() -> None:
    """A stand-in for an engine: it 'fails' when some request's prompt holds token 0 and
    a whole round follows it."""
    schedule = random_schedule(random.Random(3))
    steps = list(schedule.steps)
    steps.insert(1, Submit("bad", (9, 8, 0, 7, 6, 5, 4, 3), 9, n=2, stop=("e",)))
    steps.append(Round("whole", 5, "recompute"))
    schedule = dataclasses.replace(schedule, steps=tuple(steps))

    def run(candidate: Schedule) -> list[Failure]:
        seen_zero = False
        for step in candidate.steps:
            seen_zero |= isinstance(step, Submit) and 0 in step.prompt
            if seen_zero and isinstance(step, Round) and step.kind == "whole":
                return [Failure("logprob", "planted")]
        return []

    shrunk = shrink(schedule, Failure("logprob", "planted"), run, budget_s=30.0)
    request, round_ = shrunk.schedule.steps
    assert request.prompt == (0,) and request.n == 1 and request.stop == ()
    assert round_ == Round("whole", 5, None)


@pytest.fixture(scope="module")
def bank(tmp_path_factory: pytest.TempPathFactory) -> WeightBank:
    return WeightBank(tmp_path_factory.mktemp("exactness-parts"))


def _context(bank: WeightBank, arch: str) -> Context:
    from transformers import AutoConfig

    ledger = Ledger.starting(0, bank.state(arch, 0))
    ledger.commit(1, bank.state(arch, 1), "whole")
    reference = Reference({arch: AutoConfig.from_pretrained(bank.model_dir(arch))})
    return Context(arch, ledger, reference, eos_token_id=2, max_model_len=512)


def _greedy(ctx: Context, version: int, length: int) -> Observed:
    """What a correct engine returns: the reference's own greedy continuation."""
    state = ctx.ledger.versions[version]
    tokens: tuple[int, ...] = ()
    for _ in range(length):
        row = ctx.reference.score(ctx.arch, state, None, PROMPT + tokens).logprobs[-1]
        tokens += (int(row.argmax()),)
    scored = ctx.reference.score(ctx.arch, state, None, PROMPT + tokens[:-1])
    rows = scored.logprobs[len(PROMPT) - 1 :]
    logprobs = tuple(float(rows[i, t]) for i, t in enumerate(tokens))
    request = Submit("r0", PROMPT, length)
    spans = (Span(version, 0, length, False),)
    moe = ctx.arch != "llama"
    return Observed(
        request, 0, PROMPT, tokens, logprobs, spans, "length", None, "", scored.experts, moe,
        submitted_version=0, may_abort=False, lora_name=None,
    )  # fmt: skip


def _failures(obs: Observed, ctx: Context, **changes: object) -> list[str]:
    return [f.kind for f in check_choice(dataclasses.replace(obs, **changes), ctx, Tally())]


def test_check_passes_the_reference_and_catches_forgeries(bank: WeightBank) -> None:
    ctx = _context(bank, "llama")
    obs = _greedy(ctx, 1, 6)
    tally = Tally()
    assert check_choice(obs, ctx, tally) == [] and tally.tokens == tally.greedy == 6
    off = obs.logprobs[:3] + (obs.logprobs[3] + 2e-5,) + obs.logprobs[4:]
    assert _failures(obs, ctx, logprobs=off) == ["logprob"]
    row = ctx.reference.score("llama", ctx.ledger.versions[1], None, PROMPT).logprobs[-1]
    second = int(row.argsort(descending=True)[1])
    assert _failures(obs, ctx, tokens=(second,), logprobs=(float(row[second]),),
                     spans=(Span(1, 0, 1, False),), request=Submit("r0", PROMPT, 1)) == [
        "token"]  # fmt: skip
    assert _failures(obs, ctx, spans=(Span(0, 0, 6, False),)) == ["logprob"]  # wrong label
    assert _failures(obs, ctx, spans=(Span(2, 0, 6, False),)) == ["version"]  # never made
    assert _failures(obs, ctx, finish_reason="abort") == ["finish"]  # no abort happened
    stale = Tally()
    assert check_choice(dataclasses.replace(obs, spans=(Span(0, 0, 6, True),)), ctx, stale) == []
    assert stale.stale == 6 and stale.tokens == 0


def test_check_catches_a_wrong_expert(bank: WeightBank) -> None:
    ctx = _context(bank, "qwen3_moe")
    obs = _greedy(ctx, 0, 4)
    assert check_choice(obs, ctx, Tally()) == []
    experts = obs.experts.copy()
    layer = 0  # a sparse layer (layer 1 is dense)
    top = experts[len(PROMPT), layer]
    experts[len(PROMPT), layer] = [next(e for e in range(8) if e not in top), top[0]]
    assert _failures(obs, ctx, experts=experts) == ["experts"]
    assert _failures(obs, ctx, experts=experts[:-1]) == ["experts"]  # a row missing
    assert np.array_equal(obs.experts[:, 1], np.zeros_like(obs.experts[:, 1]))


def test_await_and_round_steps_simplify() -> None:
    from tests.exactness.shrink import candidates

    schedule = Schedule(
        random_schedule(random.Random(1)).engine, (Await("r0", 8), Round("whole", 2, "keep"))
    )
    simpler = {c.steps for c in candidates(schedule, engines=False)}
    assert (Await("r0", 4), Round("whole", 2, "keep")) in simpler
    assert (Await("r0", 8), Round("whole", 2, None)) in simpler
