"""Turns the logits of the rows that sample this step into tokens (and logprobs).

The pipeline is vLLM's: the grammar mask of structured outputs (before anything else, as
vLLM applies it to the model's logits) -> raw logits -> allowed_token_ids, bad_words,
min_tokens suppression, logit_bias and penalties -> (greedy: argmax) temperature -> min-p
-> top-k -> top-p -> draw. `logprobs_mode` says which of those distributions logprobs
report: `raw_*` the model's own (with the grammar mask, as vLLM's),
`processed_*` the one the token was actually drawn from (masked tokens are -inf), which is
what an RL trainer's importance ratio needs. Greedy rows report the processed logits at
temperature 1, as vLLM does.

Random sampling inverts the cumulative distribution: one uniform number per row picks the
token whose interval of cumulative probability holds it, found block by block in float64
(`draw_categorical`). Each seeded request draws its number from its own generator, so its
samples depend only on its own logits and seed, never on the rest of the batch. The draw
runs on exp(processed logprobs), so a reported processed logprob is exactly the log of the
probability the token was drawn with.

Why not the exponential race vLLM uses (argmax of p / q, q ~ Exp(1)): it needs a random
number per vocabulary entry. On a GPU that is free; on a CPU, for 256 rows of a 49k
vocabulary, drawing and dividing by that noise took ~35% of an RL decode step (measured),
where one number per row and a pass of block sums cost a few milliseconds.

One host sync per step: every decision is taken from the requests' parameters on the host
(which rows are greedy, whether any row uses min-p or top-p, the largest top-k); the
per-row settings, the row indices and the uniform numbers (drawn on the host, where the
per-request generators live, so that a seed samples alike on every device) go to the
device in one upload (`SamplingBatch.upload`, from pinned memory on CUDA); the tokens and
every logprob come back in one copy (`Sampler.fetch`). Rows with penalties, logit
controls or a grammar add uploads of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hotswap.config import check_logprobs_mode
from hotswap.execution.sampling_ops import (
    DRAW_BLOCK,
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    draw_categorical,
    restrict_tokens,
    token_stats,
)
from hotswap.execution.step import SamplingRequest
from hotswap.sampling_params import SamplingParams
from hotswap.structured_output import GrammarMatcher, apply_bitmasks, fill_bitmasks

__all__ = ["DRAW_BLOCK", "Sampler", "SamplerOutput", "SamplingBatch", "TokenLogprobs",
           "draw_categorical", "top_logprobs"]  # fmt: skip

Upload = Callable[[list[float]], torch.Tensor]


@dataclass
class TokenLogprobs:
    token_logprob: float
    token_rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class SamplingBatch:
    """A step's sampling settings, on the host."""

    requests: list[SamplingRequest]
    random_rows: list[int]  # rows drawn at random (the others greedy)
    wanted: list[int]  # rows that report logprobs
    suppressed: list[tuple[int, list[int]]]  # (row, token ids) banned by min_tokens
    penalized: list[int]  # rows with a repetition, presence or frequency penalty
    controlled: list[int] = field(default_factory=list)  # logit_bias, allowed/bad tokens
    # rows of structured-output requests whose grammar still constrains them, and theirs
    grammar_rows: list[int] = field(default_factory=list)
    grammars: list[GrammarMatcher] = field(default_factory=list)
    upload: Upload | None = None  # host values -> device tensor (None: torch.tensor)

    @classmethod
    def from_requests(
        cls, requests: list[SamplingRequest], upload: Upload | None = None
    ) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        return cls(
            requests=requests,
            random_rows=[row for row, p in enumerate(params) if not p.greedy],
            wanted=[row for row, p in enumerate(params) if _reports_logprobs(p)],
            suppressed=[(row, ids) for row, r in enumerate(requests) if (ids := _banned_tokens(r))],
            penalized=[row for row, p in enumerate(params) if p.has_penalties],
            controlled=[row for row, p in enumerate(params) if p.has_logits_controls],
            **_grammar_rows(requests),
            upload=upload,
        )


def _grammar_rows(requests: list[SamplingRequest]) -> dict[str, list]:
    pairs = [(row, g) for row, r in enumerate(requests) if (g := r.grammar) and g.constrains]
    return {"grammar_rows": [p[0] for p in pairs], "grammars": [p[1] for p in pairs]}


def _banned_tokens(request: SamplingRequest) -> list[int]:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = set(request.stop_token_ids)
    if request.eos_token_id is not None:
        banned.add(request.eos_token_id)
    return sorted(banned)


class _DeviceSettings:
    """What the step's device work reads, uploaded at once: row indices, the random rows'
    temperature, top-k, top-p and min-p, and their uniform numbers."""

    def __init__(self, batch: SamplingBatch, uniforms: list[float], device: torch.device,
                 vocab: int) -> None:  # fmt: skip
        rand, wanted = batch.random_rows, batch.wanted
        params = [batch.requests[r].sampling_params for r in rand]
        drawn = set(rand)
        greedy_at = [i for i, row in enumerate(wanted) if row not in drawn]
        position = {row: i for i, row in enumerate(wanted)}
        pairs = [(position[row], i) for i, row in enumerate(rand) if row in position]
        self.top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        self.uses_top_p = any(p.top_p < 1.0 for p in params)
        self.uses_min_p = any(p.min_p > 0.0 for p in params)
        ints = [rand, wanted, greedy_at, [wanted[i] for i in greedy_at],
                [d for d, _ in pairs], [s for _, s in pairs], self.top_k]  # fmt: skip
        floats = [[max(p.temperature, 1e-5) for p in params], [p.top_p for p in params],
                  [p.min_p for p in params]]  # fmt: skip
        values = [v for section in ints + floats for v in section] + uniforms
        packed = _upload(batch, values, device)
        counts = [len(s) for s in ints]
        indices = packed[: sum(counts)].long().split(counts)
        (self.random, self.wanted, self.greedy_at, self.greedy_rows, self.report_at,
         self.report_from, self.top_k_device) = indices  # fmt: skip
        n = len(rand)
        settings = packed[sum(counts) : sum(counts) + 3 * n].float().view(3, n)
        self.temperature, self.top_p, self.min_p = settings[0, :, None], settings[1], settings[2]
        self.uniforms = packed[sum(counts) + 3 * n :]


def _upload(batch: SamplingBatch, values: list[float], device: torch.device) -> torch.Tensor:
    if batch.upload is not None:
        return batch.upload(values).to(torch.float64)
    return torch.tensor(values, dtype=torch.float64, device=device)


class Sampler:
    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        rows, rand, wanted = logits.shape[0], batch.random_rows, batch.wanted
        uniforms = self._uniforms([batch.requests[r].generator for r in rand]) if rand else []
        on = _DeviceSettings(batch, uniforms, logits.device, logits.shape[-1])
        if batch.grammars:
            apply_bitmasks(
                logits, batch.grammar_rows, fill_bitmasks(batch.grammars, logits.shape[-1])
            )
        raw = self.logprobs_mode.startswith("raw")
        reported = _as_mode(logits[on.wanted], self.logprobs_mode) if wanted and raw else None
        logits = process_logits(logits, batch)
        all_random = len(rand) == rows > 0
        # same first-max tie rule as argmax, ~2x faster; not needed when no row is greedy
        tokens = None if all_random else logits.max(dim=-1).indices
        if wanted and not raw:
            reported = logits.new_empty((len(wanted), logits.shape[-1]))
            if len(on.greedy_at):
                reported[on.greedy_at] = _as_mode(logits[on.greedy_rows], self.logprobs_mode)
        if rand:
            # With no greedy row the logits are not read again: sampled in place, no copy.
            chosen = logits if all_random else logits[on.random]
            drawn, distribution = self._sample(chosen, on)
            if tokens is None:
                tokens = drawn
            else:
                tokens[on.random] = drawn
            if reported is not None and not raw and len(on.report_at):
                reported[on.report_at] = distribution[on.report_from]
        return self._read_back(tokens, reported, on, batch)

    def fetch(self, packed: torch.Tensor) -> torch.Tensor:
        """The step's one device-to-host copy (a test may watch it)."""
        return packed.cpu()

    def _read_back(self, tokens: torch.Tensor, reported: torch.Tensor | None,
                   on: _DeviceSettings, batch: SamplingBatch) -> SamplerOutput:  # fmt: skip
        """Tokens and logprobs, packed into one float64 tensor (exact for ids, ranks and
        float32 values) and copied back at once."""
        ks = [batch.requests[row].sampling_params.logprobs or 0 for row in batch.wanted]
        parts = [tokens.double()]
        if reported is not None:
            stats = token_stats(reported, tokens[on.wanted], max(ks, default=0))
            parts += [t.double().flatten() for t in stats]
        values = self.fetch(torch.cat(parts)).tolist()
        token_list = [int(t) for t in values[: len(tokens)]]
        results: list[TokenLogprobs | None] = [None] * len(token_list)
        if reported is not None:
            found = _unpack_stats(values[len(tokens) :], ks)
            for row, entry in zip(batch.wanted, found):
                results[row] = entry
        return SamplerOutput(token_list, results)

    def _sample(
        self, logits: torch.Tensor, on: _DeviceSettings
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens, and the distribution they were drawn from in the form the
        logprobs mode reports (processed logprobs: the very values the draw used)."""
        logits = logits.div_(on.temperature)  # the caller's copy (or spent logits)
        logits = apply_min_p(logits, on.min_p, on.uses_min_p)
        logits = apply_top_k(logits, on.top_k_device, max(on.top_k, default=0))
        logits = apply_top_p(logits, on.top_p, on.uses_top_p)
        logprobs = torch.log_softmax(logits, dim=-1)
        drawn = draw_categorical(logprobs.exp(), on.uniforms)
        return drawn, logits if self.logprobs_mode == "processed_logits" else logprobs

    def _uniforms(self, generators: list) -> list[float]:  # noqa: ANN001
        """One float64 number in [0, 1) per row, drawn on the host (where the per-request
        generators live), so a seed samples the same tokens on every device. Rows of
        unseeded requests come from the sampler's generator, each seeded row from its own
        and only from it."""
        if all(g is None for g in generators):
            return torch.rand(len(generators), generator=self.generator,
                              dtype=torch.float64).tolist()  # fmt: skip
        return [torch.rand(1, generator=g or self.generator, dtype=torch.float64).item()
                for g in generators]  # fmt: skip


def _unpack_stats(values: list[float], ks: list[int]) -> list[TokenLogprobs]:
    """`token_stats`' four tensors, flattened in order, back into one entry per row."""
    m, k_max = len(ks), max(ks, default=0)
    token_values, ranks = values[:m], values[m : 2 * m]
    ids, tops = values[2 * m : 2 * m + m * k_max], values[2 * m + m * k_max :]
    return [
        TokenLogprobs(
            token_values[i],
            int(ranks[i]),
            [int(t) for t in ids[i * k_max : i * k_max + k]],
            tops[i * k_max : i * k_max + k],
        )  # fmt: skip
        for i, k in enumerate(ks)
    ]


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """allowed_token_ids, bad_words, min_tokens suppression, logit_bias and penalties, in
    place (vLLM's order): what greedy rows take the argmax of and random rows scale by
    their temperature."""
    for row in batch.controlled:
        restrict_tokens(logits, row, batch.requests[row])
    for row, ids in batch.suppressed:
        logits[row, ids] = float("-inf")
    for row in batch.controlled:
        add_logit_bias(logits, row, batch.requests[row])
    for row in batch.penalized:
        logits[row] = apply_penalties(logits[row], batch.requests[row])
    return logits


def _as_mode(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """Logits in the form `mode` reports them (a new tensor either way)."""
    return torch.log_softmax(logits, dim=-1) if mode.endswith("logprobs") else logits.clone()


def top_logprobs(values: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row of `values`: the value of `tokens[i]`, its rank (1 = highest) and the row's
    top `ks[i]` (prompt logprobs: host token ids)."""
    index = torch.tensor(tokens, dtype=torch.long, device=values.device)
    stats = token_stats(values, index, max(ks, default=0))
    flat = torch.cat([t.double().flatten() for t in stats]).cpu().tolist()
    return _unpack_stats(flat, ks)


def _reports_logprobs(params: SamplingParams) -> bool:
    """Whether the sampled token's logprob is computed: asked for, or needed for the
    FP8-bf16 gap of return_bf16_logprobs (engine/scoring.py)."""
    return params.logprobs is not None or params.return_bf16_logprobs
