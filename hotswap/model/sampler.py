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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotswap.config import check_logprobs_mode
from hotswap.model.step import SamplingRequest
from hotswap.structured_output import GrammarMatcher, apply_bitmasks, fill_bitmasks


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
    requests: list[SamplingRequest]
    greedy: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R, 1]
    top_k: list[int]
    top_p: torch.Tensor  # [R]
    min_p: torch.Tensor  # [R]
    suppressed: list[tuple[int, list[int]]]  # (row, token ids) banned by min_tokens
    penalized: list[int]  # rows with a repetition, presence or frequency penalty
    controlled: list[int] = field(default_factory=list)  # logit_bias, allowed/bad tokens
    # rows of structured-output requests whose grammar still constrains them, and theirs
    grammar_rows: list[int] = field(default_factory=list)
    grammars: list[GrammarMatcher] = field(default_factory=list)

    @classmethod
    def from_requests(
        cls, requests: list[SamplingRequest], device: torch.device | str = "cpu"
    ) -> SamplingBatch:
        """Per-row settings as tensors on the logits' device."""
        params = [r.sampling_params for r in requests]
        return cls(
            requests=requests,
            greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device),
            temperature=torch.tensor([[max(p.temperature, 1e-5)] for p in params], device=device),
            top_k=[p.top_k for p in params],
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            suppressed=[(row, ids) for row, r in enumerate(requests) if (ids := _banned_tokens(r))],
            penalized=[row for row, p in enumerate(params) if p.has_penalties],
            controlled=[row for row, p in enumerate(params) if p.has_logits_controls],
            **_grammar_rows(requests),
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


class Sampler:
    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        wanted = [i for i, r in enumerate(batch.requests) if r.sampling_params.logprobs is not None]
        if batch.grammars:
            apply_bitmasks(
                logits, batch.grammar_rows, fill_bitmasks(batch.grammars, logits.shape[-1])
            )
        raw = self.logprobs_mode.startswith("raw")
        reported = _as_mode(logits[wanted], self.logprobs_mode) if wanted and raw else None
        logits = process_logits(logits, batch)
        random_rows = [row for row, greedy in enumerate(batch.greedy.tolist()) if not greedy]
        all_random = len(random_rows) == len(logits) > 0
        # same first-max tie rule as argmax, ~2x faster; not needed when no row is greedy
        tokens = None if all_random else logits.max(dim=-1).indices
        if wanted and not raw:
            reported = self._processed_greedy_rows(logits, batch, wanted)
        if random_rows:
            # With no greedy row the logits are not read again: sampled in place, no copy.
            chosen = logits if all_random else logits[random_rows]
            drawn, distribution = self._sample(chosen, batch, random_rows)
            if tokens is None:
                tokens = drawn
            else:
                tokens[random_rows] = drawn
            if reported is not None and not raw:
                _report_random_rows(reported, distribution, wanted, random_rows)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _gather_logprobs(reported, token_list, wanted, batch))

    def _processed_greedy_rows(
        self, logits: torch.Tensor, batch: SamplingBatch, wanted: list[int]
    ) -> torch.Tensor:
        """The reported rows, filled for greedy requests (processed logits at temperature
        1, as vLLM); random requests' rows are filled from what they are drawn from."""
        reported = logits.new_empty((len(wanted), logits.shape[-1]))
        greedy = batch.greedy.tolist()
        positions = [i for i, row in enumerate(wanted) if greedy[row]]
        if positions:
            rows = [wanted[i] for i in positions]
            reported[positions] = _as_mode(logits[rows], self.logprobs_mode)
        return reported

    def _sample(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens, and the distribution they were drawn from in the form the
        logprobs mode reports (processed logprobs: the very values the draw used)."""
        logits = logits.div_(batch.temperature[rows])  # the caller's copy (or spent logits)
        logits = _apply_min_p(logits, batch.min_p[rows])
        logits = _apply_top_k(logits, [batch.top_k[r] for r in rows])
        logits = _apply_top_p(logits, batch.top_p[rows])
        logprobs = torch.log_softmax(logits, dim=-1)
        uniforms = self._uniforms([batch.requests[r].generator for r in rows])
        drawn = draw_categorical(logprobs.exp(), uniforms.to(logits.device))
        return drawn, logits if self.logprobs_mode == "processed_logits" else logprobs

    def _uniforms(self, generators: list) -> torch.Tensor:  # noqa: ANN001
        """One float64 number in [0, 1) per row, drawn on the host (where the per-request
        generators live), so a seed samples the same tokens on every device. Rows of
        unseeded requests come from the sampler's generator, each seeded row from its own
        and only from it."""
        if all(g is None for g in generators):
            return torch.rand(len(generators), generator=self.generator, dtype=torch.float64)
        return torch.cat([
            torch.rand(1, generator=g or self.generator, dtype=torch.float64) for g in generators
        ])  # fmt: skip


# Tokens per block of the two-level search: block sums are one pass over the row, then
# only the chosen block's probabilities are summed in order.
DRAW_BLOCK = 256


def draw_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` ([R, V], non-negative, any positive total), the token whose
    interval of cumulative probability holds `uniforms[r]` times the row's total: token i
    is drawn with probability p_i / total. Two levels: the block holding that point (block
    sums in float32, each off by at most ~1e-6 of its own mass, accumulated in float64),
    then the token within the block, from a float64 running sum of the block's entries
    scaled to the same fraction of the block. A float32 running sum over the whole row
    would instead round away the intervals of tokens below ~1e-7 of the total. A token of
    probability 0 is never drawn."""
    vocab = probs.shape[-1]
    blocks = _block_sums(probs).double()  # [R, blocks]
    sums = blocks.cumsum(dim=-1)
    target = uniforms.to(sums.dtype)[:, None] * sums[:, -1:]
    block = torch.minimum(torch.searchsorted(sums, target, right=True), _last_positive(blocks))
    mass = blocks.gather(1, block)
    fraction = ((target - (sums.gather(1, block) - mass)) / mass).clamp(0.0, 1.0)
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)
    entries = probs.gather(1, columns.clamp(max=vocab - 1)).double()
    entries = entries.masked_fill(columns >= vocab, 0.0)
    running = entries.cumsum(dim=-1)
    within = torch.searchsorted(running, fraction * running[:, -1:], right=True)
    within = torch.minimum(within, _last_positive(entries))
    return (block * DRAW_BLOCK + within).flatten()


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """[R, ceil(V / DRAW_BLOCK)] sums of consecutive blocks of each row (a float32
    vectorised pass: 10x faster here than summing into float64)."""
    rows, vocab = probs.shape
    whole = vocab - vocab % DRAW_BLOCK
    sums = probs[:, :whole].reshape(rows, -1, DRAW_BLOCK).sum(dim=-1)
    if whole == vocab:
        return sums
    return torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=-1)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """[R, 1] column of each row's last positive entry (0 if none)."""
    columns = torch.arange(values.shape[-1], device=values.device)
    return torch.where(values > 0, columns, 0).amax(dim=-1, keepdim=True)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """allowed_token_ids, bad_words, min_tokens suppression, logit_bias and penalties, in
    place (vLLM's order): what greedy rows take the argmax of and random rows scale by
    their temperature."""
    for row in batch.controlled:
        _restrict_tokens(logits, row, batch.requests[row])
    for row, ids in batch.suppressed:
        logits[row, ids] = float("-inf")
    for row in batch.controlled:
        _add_logit_bias(logits, row, batch.requests[row])
    for row in batch.penalized:
        logits[row] = apply_penalties(logits[row], batch.requests[row])
    return logits


def _restrict_tokens(logits: torch.Tensor, row: int, request: SamplingRequest) -> None:
    """allowed_token_ids: every other token -inf; bad_words: the last token of each bad
    word whose other tokens the output ends with -inf (vLLM's semantics)."""
    params = request.sampling_params
    if params.allowed_token_ids:
        keep = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = logits[row, keep]
        logits[row] = float("-inf")
        logits[row, keep] = kept
    output = request.output_token_ids
    banned = [
        word[-1]
        for word in params.bad_words_token_ids or ()
        if len(word) == 1 or (len(output) >= len(word) - 1 and _ends_with(output, word[:-1]))
    ]
    if banned:
        logits[row, banned] = float("-inf")


def _ends_with(tokens: list[int], suffix: list[int]) -> bool:
    return tokens[len(tokens) - len(suffix) :] == suffix


def _add_logit_bias(logits: torch.Tensor, row: int, request: SamplingRequest) -> None:
    bias = request.sampling_params.logit_bias
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[row].index_add_(0, ids, values)


def apply_penalties(logits: torch.Tensor, request: SamplingRequest) -> torch.Tensor:
    """vLLM's (and OpenAI's) definitions on one row: a token seen in the prompt or the
    output has its logit divided by the repetition penalty if positive, else multiplied;
    then the output's count of it times the frequency penalty and, if it occurs at all,
    the presence penalty are subtracted."""
    params = request.sampling_params
    vocab, device = logits.shape[-1], logits.device
    output = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
    in_output = counts > 0
    if params.repetition_penalty != 1.0:
        seen = in_output.clone()
        prompt = request.all_token_ids[: request.num_prompt_tokens]
        seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        penalty = torch.where(seen, params.repetition_penalty, 1.0).to(logits.dtype)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * in_output.to(logits.dtype)
    return logits


def _as_mode(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """Logits in the form `mode` reports them (a new tensor either way)."""
    return torch.log_softmax(logits, dim=-1) if mode.endswith("logprobs") else logits.clone()


def _report_random_rows(
    reported: torch.Tensor, distribution: torch.Tensor, wanted: list[int], random_rows: list[int]
) -> None:
    """Replace the reported rows of randomly sampled requests by the distribution they
    were drawn from (rows of `distribution` follow `random_rows`)."""
    position = {row: i for i, row in enumerate(wanted)}
    pairs = [(position[row], i) for i, row in enumerate(random_rows) if row in position]
    if pairs:
        dest, src = (list(t) for t in zip(*pairs))
        reported[dest] = distribution[src]


def _gather_logprobs(
    reported: torch.Tensor | None, tokens: list[int], wanted: list[int], batch: SamplingBatch
) -> list[TokenLogprobs | None]:
    results: list[TokenLogprobs | None] = [None] * len(tokens)
    if reported is None:
        return results
    ks = [batch.requests[row].sampling_params.logprobs or 0 for row in wanted]
    found = top_logprobs(reported, [tokens[row] for row in wanted], ks)
    for row, entry in zip(wanted, found):
        results[row] = entry
    return results


def top_logprobs(values: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row of `values`: the value of `tokens[i]`, its rank (1 = highest) and the row's
    top `ks[i]`, in one pass over the batch."""
    index = torch.tensor(tokens, dtype=torch.long, device=values.device)[:, None]
    token_values = values.gather(1, index)
    ranks = ((values > token_values).sum(dim=-1) + 1).tolist()
    k_max = max(ks, default=0)
    top_ids: list[list[int]] = [[] for _ in tokens]
    top_values: list[list[float]] = [[] for _ in tokens]
    if k_max:
        top = values.topk(k_max, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(value, rank, ids[:k], vals[:k])
        for value, rank, ids, vals, k in zip(
            token_values.flatten().tolist(), ranks, top_ids, top_values, ks
        )
    ]


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely one's."""
    if bool((min_p <= 0.0).all()):
        return logits
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    threshold = logits.amax(dim=-1, keepdim=True) + min_p[:, None].log()
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    if not any(ks):
        return logits
    k_max = max(ks)
    values = logits.topk(k_max, dim=-1).values
    kth = values.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=logits.device))
    active = torch.tensor([[k > 0] for k in ks], device=logits.device)
    return logits.masked_fill(active & (logits < kth), float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    if bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
