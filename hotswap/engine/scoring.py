"""`return_bf16_logprobs`: a finished request's sampled tokens scored by the unquantized
(bf16) policy, so a trainer rolling out in FP8 sees how far the policy that sampled is
from the one it trains (issue 41; the README's FP8 section has the TIS recipe).

With `--enable-bf16-logprobs` an FP8 engine keeps each quantized weight's bf16 value as
the trainer sent it beside the codes (model/reference.py), through every round. When such
a request finishes, before its final output leaves the core, its prompt and output run
as one prefill through the bf16 weights (`serving_reference`), and each output token's
raw log-softmax is read from the row before it, as prompt logprobs are. On an engine
without FP8 weights the pass runs the engine's own weights.

Invariants:
- Scoring runs between two steps of the core, right after the step that finished the
  request, so it reads the weights of the version its last token was sampled under
  (tokens sampled under older versions, across a round, are scored by the newest one).
- Its KV goes to blocks taken from the pool for the pass and freed after it, never
  registered in the prefix cache (their keys and values are the bf16 policy's). If the
  pool is short, running requests are preempted (recomputed later), as the scheduler
  does; KV capacity >= max_model_len guarantees room for any one request.
- The KV cache keeps its dtype: with --kv-cache-dtype fp8 the pass reads FP8 keys and
  values too (only the weights differ).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from hotswap.engine.request import Request
from hotswap.engine.scheduler import Scheduler
from hotswap.execution.runner import ModelRunner
from hotswap.sampling_params import SamplingParams

# What the pass asks the runner for: each scored position's own token's logprob, raw.
_SCORE = SamplingParams(max_tokens=1, prompt_logprobs=0)


@dataclass
class ScoringRequest:
    """A finished request as one long prompt (its prompt and output tokens), whose
    positions from the original prompt's last on are scored (the runner's StepRequest)."""

    source: Request
    block_ids: list[int]
    request_id: str = field(init=False)
    all_token_ids: list[int] = field(init=False)
    prompt_logprobs: list = field(init=False)
    # what a sampling request has, unused: nothing is sampled
    eos_token_id = None
    stop_token_ids: frozenset[int] = frozenset()
    output_token_ids = ()
    num_output_tokens = 0
    generator = None
    grammar = None

    def __post_init__(self) -> None:
        source = self.source
        self.request_id = source.request_id
        self.all_token_ids = source.all_token_ids
        # Positions before the prompt's last predict prompt tokens: marked as scored.
        self.prompt_logprobs = [None] * (source.num_prompt_tokens - 1)

    @property
    def sampling_params(self) -> SamplingParams:
        return _SCORE

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return True

    @property
    def lora(self):  # noqa: ANN201 - the source's adapter, scored with it
        return self.source.lora

    @property
    def images(self):  # noqa: ANN201 - the source's images, in its prompt
        return self.source.images

    @property
    def routed_experts_start(self) -> int:
        return len(self.all_token_ids)  # none read

    @property
    def num_to_compute(self) -> int:
        """The last token's KV is not needed: nothing after it is scored."""
        return len(self.all_token_ids) - 1

    def token_logprobs(self) -> list[float]:
        return [entry.token_logprob for entry in self.prompt_logprobs[self.first_scored :]]

    @property
    def first_scored(self) -> int:
        return self.source.num_prompt_tokens - 1


@dataclass
class _Chunk:
    """Tokens [start, start + num_tokens) of a scoring request (the runner's chunk)."""

    request: ScoringRequest
    start: int
    num_tokens: int
    samples: bool = False


@dataclass
class _Plan:
    scheduled: list[_Chunk]


@dataclass
class Bf16Gap:
    """The gap over every scored token, for /metrics: how many, the sum of
    |sampled logprob - bf16 logprob|, and how many a truncated importance weight
    exp(bf16 - sampled) clips at TIS_CAP (the README's recipe). Counted only where the
    sampled logprobs are raw ones (--logprobs-mode raw_logprobs, the default)."""

    tokens: int = 0
    abs_diff_sum: float = 0.0
    clipped: int = 0

    def record(self, sampled: list[float], bf16: list[float]) -> None:
        for lp, ref in zip(sampled, bf16, strict=True):
            if math.isfinite(lp) and math.isfinite(ref):
                self.tokens += 1
                self.abs_diff_sum += abs(lp - ref)
                self.clipped += ref - lp > math.log(TIS_CAP)

    def stats(self) -> dict[str, int | float]:
        return {"bf16_scored_tokens": self.tokens, "bf16_logprob_abs_diff_sum": self.abs_diff_sum,
                "bf16_tis_clipped_tokens": self.clipped}  # fmt: skip


TIS_CAP = 2.0  # C in min(exp(logp_bf16 - logp_sampled), C)


class Bf16Scorer:
    """Scores finished requests that asked for `return_bf16_logprobs` (module doc)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, token_budget: int,
                 logprobs_mode: str) -> None:  # fmt: skip
        self.runner = runner
        self.scheduler = scheduler
        self.token_budget = token_budget  # tokens per forward (max_num_batched_tokens)
        self.raw = logprobs_mode == "raw_logprobs"  # sampled logprobs comparable to bf16 ones
        self.gap = Bf16Gap()

    def score(self, requests: list[Request]) -> None:
        """Set each request's `bf16_logprobs`: requests finished together are scored in
        one pass, as many as the step's token budget and the KV cache hold."""
        for group in self._groups([r for r in requests if r.num_output_tokens]):
            for request, logprobs in zip(group, self._score_group(group), strict=True):
                request.bf16_logprobs = logprobs
                if self.raw:
                    self.gap.record(request.sampled_logprobs, logprobs)

    def _groups(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Consecutive requests whose tokens fit the budget and whose blocks fit the
        cache together (a request alone may exceed the budget: it runs in chunks)."""
        kv, group, tokens, blocks = self.scheduler.kv, [], 0, 0
        for request in requests:
            count = request.num_tokens - 1
            need = kv.blocks_needed(count)
            if group and (tokens + count > self.token_budget
                          or blocks + need > kv.pool.num_blocks):  # fmt: skip
                yield group
                group, tokens, blocks = [], 0, 0
            group.append(request)
            tokens, blocks = tokens + count, blocks + need
        if group:
            yield group

    def _score_group(self, group: list[Request]) -> list[list[float]]:
        kv = self.scheduler.kv
        needs = [kv.blocks_needed(r.num_tokens - 1) for r in group]
        self.scheduler.make_room(sum(needs))
        scorings = [ScoringRequest(r, kv.pool.allocate(n)) for r, n in zip(group, needs)]
        try:
            done = {s.request_id: 0 for s in scorings}  # tokens computed, per request
            while any(done[s.request_id] < s.num_to_compute for s in scorings):
                chunks, budget = [], self.token_budget
                for s in scorings:
                    count = min(budget, s.num_to_compute - done[s.request_id])
                    if count > 0:
                        chunks.append(_Chunk(s, done[s.request_id], count))
                        budget -= count
                result = self.runner.execute(_Plan(chunks), reference=True)
                for chunk in chunks:
                    scored = result.prompt_logprobs.get(chunk.request.request_id, [])
                    chunk.request.prompt_logprobs.extend(scored)
                    done[chunk.request.request_id] += chunk.num_tokens
        finally:
            for s in scorings:
                kv.pool.free(s.block_ids[::-1])
        return [s.token_logprobs() for s in scorings]
