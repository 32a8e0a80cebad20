"""Sampler unit tests on hand-made logits and real engine Requests."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hotswap.engine.request import Request
from hotswap.execution.sampler import (
    DRAW_BLOCK,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    draw_categorical,
)
from hotswap.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(params: SamplingParams, eos_token_id: int | None = None) -> Request:
    return Request(f"r{next(_ids)}", [1, 2, 3], params, eos_token_id)


def run(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    assert logits.shape[0] == len(requests)
    return sampler(logits.clone(), SamplingBatch.from_requests(requests))


def sample_rows(
    logits: torch.Tensor, params: SamplingParams, rows: int, sampler_seed: int = 0
) -> torch.Tensor:
    """`rows` independent draws from one distribution, as one batch of unseeded rows."""
    requests = [make_request(params) for _ in range(rows)]
    out = run(Sampler(sampler_seed), logits.expand(rows, -1), requests)
    return torch.tensor(out.token_ids)


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]


def assert_matches(samples: torch.Tensor, expected: torch.Tensor, tol: float = 0.03) -> None:
    """Empirical frequencies against `expected`: a chi-square test (p < 1e-3 fails) and
    an absolute tolerance per token."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    expected = expected.double()
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    support = expected > 0
    chi2 = float(((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    df = int(support.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at p = 1e-3 (z = 3.09).
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, (counts / n).tolist(), expected.tolist())
    assert torch.allclose(counts / n, expected, atol=tol), ((counts / n).tolist(), expected)


# -- greedy and top-k -----------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(8)]
    out = run(Sampler(), logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_mixed_with_random_rows_stay_argmax() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, seed=3)] * 3
    out = run(Sampler(), logits, [make_request(p) for p in params])
    assert out.token_ids[::2] == logits[::2].argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 100.0, 1e4])
def test_top_k_1_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=temperature, top_k=1, seed=s) for s in range(8)]
    params += [SamplingParams(temperature=temperature, top_k=1)] * 8
    for sampler_seed in range(3):
        out = run(Sampler(sampler_seed), logits, [make_request(p) for p in params])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_never_samples_outside_the_top_k(k: int) -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(3))
    top = set(logits[0].topk(k).indices.tolist())
    # high temperature flattens the distribution: without the cut, outsiders would win often
    params = SamplingParams(temperature=10.0, top_k=k)
    unseeded = sample_rows(logits, params, 2000)
    seeded = [
        run(Sampler(), logits, [make_request(SamplingParams(temperature=10.0, top_k=k, seed=s))])
        for s in range(300)
    ]
    seeded_tokens = {o.token_ids[0] for o in seeded}
    assert set(unseeded.tolist()) == top  # every one of the top k is reachable
    assert seeded_tokens == top


def test_top_k_at_or_above_vocab_size_is_no_cut() -> None:
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    assert_matches(sample_rows(logits, SamplingParams(top_k=4), 4000), logits.softmax(-1)[0])
    assert_matches(sample_rows(logits, SamplingParams(top_k=100), 4000), logits.softmax(-1)[0])


# -- top-p and min-p ------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_covering_p() -> None:
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    # p = 0.7: {0, 1} (0.8) is the smallest covering set; renormalized 0.625 / 0.375
    samples = sample_rows(logits, SamplingParams(top_p=0.7), 4000)
    assert_matches(samples, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # p = 0.85: {0, 1, 2} (0.95); index 3 never
    samples = sample_rows(logits, SamplingParams(top_p=0.85), 4000)
    assert_matches(samples, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # p = 0.4: the top token alone covers it
    assert set(sample_rows(logits, SamplingParams(top_p=0.4), 500).tolist()) == {0}


def test_top_p_is_order_independent() -> None:
    """The same distribution with the tokens permuted keeps the same tokens."""
    logits = log_probs([0.05, 0.3, 0.15, 0.5])
    samples = sample_rows(logits, SamplingParams(top_p=0.85), 4000)
    assert_matches(samples, torch.tensor([0.0, 0.3, 0.15, 0.5]) / 0.95)


def test_min_p_masks_tokens_below_min_p_times_max() -> None:
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    # threshold 0.3 * 0.4 = 0.12: token 3 (0.1) goes
    samples = sample_rows(logits, SamplingParams(min_p=0.3), 4000)
    assert_matches(samples, torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)
    # threshold 0.6 * 0.4 = 0.24: only tokens 0 and 1 remain
    samples = sample_rows(logits, SamplingParams(min_p=0.6), 2000)
    assert set(samples.tolist()) == {0, 1}
    # min_p = 1: only the most likely token
    assert set(sample_rows(logits, SamplingParams(min_p=1.0), 500).tolist()) == {0}


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    out = run(Sampler(), logits, [make_request(params, eos_token_id=2)])
    assert out.token_ids == [4]
    request = make_request(params, eos_token_id=2)
    request.append_output_token(4)
    request.append_output_token(4)  # min_tokens reached: eos is allowed again
    assert run(Sampler(), logits, [request]).token_ids == [2]


# -- seeds ----------------------------------------------------------------------------------


STEPS = 12
VOCAB = 64


def _step_logits(seed: int, rows: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, VOCAB, generator=gen) * 0.5 for _ in range(STEPS)]


def _seeded_sequence(
    params: SamplingParams, others: list[SamplingParams], position: int, sampler_seed: int
) -> list[int]:
    """The tokens a request draws over STEPS calls, placed at `position` among `others`
    (which get their own logits) in every call."""
    target = make_request(params)
    neighbours = [make_request(p) for p in others]
    mine = _step_logits(100)
    theirs = _step_logits(sampler_seed + 7, rows=max(len(others), 1))
    sampler = Sampler(sampler_seed)
    tokens = []
    for step in range(STEPS):
        requests = neighbours[:position] + [target] + neighbours[position:]
        rows = list(theirs[step][: len(others)])
        rows.insert(position, mine[step][0])
        out = run(sampler, torch.stack(rows), requests)
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_request_ignores_the_batch_and_the_sampler_seed() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = _seeded_sequence(params, [], 0, sampler_seed=0)
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=1234),  # the same seed elsewhere in the batch
        SamplingParams(temperature=1.0, top_k=5, seed=9),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    assert _seeded_sequence(params, others, 3, sampler_seed=0) == alone
    assert _seeded_sequence(params, others[:2], 0, sampler_seed=99) == alone
    assert _seeded_sequence(params, others, 5, sampler_seed=12345) == alone
    assert len(set(alone)) > 3  # a real random sequence, not a constant


def test_different_seeds_give_different_sequences() -> None:
    sequences = {
        tuple(_seeded_sequence(SamplingParams(seed=seed), [], 0, sampler_seed=0))
        for seed in range(5)
    }
    assert len(sequences) == 5


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    params = SamplingParams(temperature=1.0)
    first = _seeded_sequence(params, [], 0, sampler_seed=1)
    assert _seeded_sequence(params, [], 0, sampler_seed=1) == first
    assert _seeded_sequence(params, [], 0, sampler_seed=2) != first


# -- distribution ---------------------------------------------------------------------------


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    samples = sample_rows(LOGITS, SamplingParams(temperature=temperature), 4000)
    assert_matches(samples, (LOGITS / temperature).softmax(-1)[0])


def test_seeded_draws_across_seeds_match_softmax() -> None:
    requests = [make_request(SamplingParams(temperature=1.0, seed=s)) for s in range(4000)]
    out = run(Sampler(), LOGITS.expand(4000, -1), requests)
    assert_matches(torch.tensor(out.token_ids), LOGITS.softmax(-1)[0])


def test_one_seeded_request_over_many_steps_matches_softmax() -> None:
    request = make_request(SamplingParams(temperature=1.0, seed=42))
    sampler = Sampler()
    tokens = [run(sampler, LOGITS, [request]).token_ids[0] for _ in range(4000)]
    assert_matches(torch.tensor(tokens), LOGITS.softmax(-1)[0])


# -- the inverse-CDF draw, against a float64 cumulative sum over the whole row ---------------


def reference_draw(probs: torch.Tensor, u: float) -> int:
    """The first token whose float64 cumulative probability exceeds u * total."""
    running = probs.double().cumsum(0)
    return int(torch.searchsorted(running, u * running[-1], right=True))


@pytest.mark.parametrize("vocab", [7, DRAW_BLOCK, 3 * DRAW_BLOCK + 17, 49152])
def test_draw_matches_a_whole_row_cumulative_sum(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=generator) ** 8  # skewed, many tiny entries
    probs[:, torch.randperm(vocab, generator=generator)[: vocab // 3]] = 0.0  # and zeros
    probs[:, 0] += 1e-3  # no all-zero row
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    drawn = draw_categorical(probs, uniforms).tolist()
    for row, (token, u) in enumerate(zip(drawn, uniforms.tolist())):
        running = probs[row].double().cumsum(0)
        point = u * float(running[-1])
        # the block sums are float32: a point within 1e-5 of an interval's edge may round
        # to either side of it (a random point lands there about once in 10^4 draws)
        near_edge = bool(((running - point).abs() < 1e-5 * float(running[-1])).any())
        assert probs[row, token] > 0
        assert near_edge or token == reference_draw(probs[row], u), (row, u)


def test_draw_never_picks_a_zero_probability_token_at_the_ends() -> None:
    vocab = 5 * DRAW_BLOCK + 3
    probs = torch.zeros(3, vocab)
    probs[:, DRAW_BLOCK + 5] = 0.25  # zeros before it, whole empty blocks after it
    probs[:, 2 * DRAW_BLOCK + 1] = 0.75
    largest_below_one = 1.0 - 2.0**-53
    uniforms = torch.tensor([0.0, 0.25, largest_below_one], dtype=torch.float64)
    assert draw_categorical(probs, uniforms).tolist() == [
        DRAW_BLOCK + 5,
        2 * DRAW_BLOCK + 1,
        2 * DRAW_BLOCK + 1,
    ]


def first_uniform_drawing_at_least(probs: torch.Tensor, token: int) -> float:
    """Bisection over u: the smallest u in [0, 1) whose draw is `token` or later."""
    low, high = 0.0, 1.0
    for _ in range(64):
        mid = (low + high) / 2
        drawn = int(draw_categorical(probs, torch.tensor([mid], dtype=torch.float64)))
        low, high = (low, mid) if drawn >= token else (mid, high)
    return high


def test_draw_keeps_the_probability_of_a_token_far_below_float32_resolution() -> None:
    """A token of probability 1e-9 behind 40k others: a float32 running sum (ulp 6e-8 near
    the total) would give it an empty or a ~60x widened interval. The set of uniforms
    drawing it must measure its probability."""
    vocab, tiny = 49152, 40_000
    probs = torch.full((1, vocab), (1 - 1e-9) / (vocab - 1), dtype=torch.float32)
    probs[0, tiny] = 1e-9
    expected = 1e-9 / float(probs[0].double().sum())
    width = first_uniform_drawing_at_least(probs, tiny + 1) - first_uniform_drawing_at_least(
        probs, tiny
    )
    assert width == pytest.approx(expected, rel=1e-4)


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_rank_and_top_values() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0, seed=0),  # no logprobs
        SamplingParams(temperature=0.0, logprobs=0),  # sampled token only
        SamplingParams(temperature=3.0, seed=11, logprobs=3),
    ]
    out = run(Sampler(), logits, [make_request(p) for p in params])
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None

    greedy = out.logprobs[0]
    assert greedy is not None and greedy.token_rank == 1
    top = expected[0].topk(5)
    assert greedy.top_ids == top.indices.tolist()
    assert greedy.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert greedy.token_logprob == pytest.approx(float(top.values[0]), abs=1e-5)

    only = out.logprobs[2]
    assert only is not None and only.top_ids == [] and only.top_logprobs == []
    assert only.token_rank == 1
    assert only.token_logprob == pytest.approx(float(expected[2].max()), abs=1e-5)

    # A sampled row: logprobs of the raw logits (not the temperature-scaled ones).
    sampled = out.logprobs[3]
    token = out.token_ids[3]
    assert sampled is not None
    assert sampled.token_logprob == pytest.approx(float(expected[3, token]), abs=1e-5)
    order = expected[3].argsort(descending=True).tolist()
    assert sampled.token_rank == order.index(token) + 1
    assert sampled.top_ids == order[:3]
    assert sampled.top_logprobs == pytest.approx(expected[3, order[:3]].tolist(), abs=1e-5)


def test_logprob_rank_of_low_ranked_samples() -> None:
    """At high temperature many draws are not the argmax: each rank must be the sampled
    token's position in the sorted log-softmax."""
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(6))
    expected = torch.log_softmax(logits[0], dim=-1)
    order = expected.argsort(descending=True).tolist()
    requests = [make_request(SamplingParams(temperature=50.0, logprobs=2)) for _ in range(200)]
    out = run(Sampler(), logits.expand(200, -1), requests)
    ranks = set()
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp is not None
        assert lp.token_rank == order.index(token) + 1
        assert lp.token_logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert lp.top_ids == order[:2]
        ranks.add(lp.token_rank)
    assert len(ranks) > 5


class CountingReads(Sampler):
    """Counts the sampler's device-to-host copies; on the `meta` device any other host read
    (`.tolist()`, `.item()`, `bool()` of a tensor) raises."""

    reads = 0

    def fetch(self, packed: torch.Tensor) -> torch.Tensor:
        self.reads += 1
        return torch.zeros(packed.shape, dtype=packed.dtype)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
def test_a_step_reads_back_once_and_uploads_once(mode: str) -> None:
    """Greedy and random rows, top-k, top-p, min-p, seeded and unseeded, logprobs on some:
    the decisions come from the host, so one upload in and one copy out."""
    requests = [
        make_request(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, logprobs=3)),
        make_request(SamplingParams(temperature=0.0, logprobs=1)),
        make_request(SamplingParams(temperature=1.0, seed=3)),
        make_request(SamplingParams(temperature=0.0)),
    ]
    uploads = []

    def upload(values: list[float]) -> torch.Tensor:
        uploads.append(len(values))
        return torch.tensor(values, dtype=torch.float64, device="meta")

    sampler = CountingReads(0, mode)
    logits = torch.empty(len(requests), 1000, device="meta")
    out = sampler(logits, SamplingBatch.from_requests(requests, upload))
    assert sampler.reads == 1 and len(uploads) == 1
    assert len(out.token_ids) == 4 and out.logprobs[2] is None and len(out.logprobs[0].top_ids) == 3
