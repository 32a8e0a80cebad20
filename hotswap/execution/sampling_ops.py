"""The sampler's operations on logits: vLLM's per-request controls and penalties, the
min-p / top-k / top-p filters, the inverse-CDF draw and top-logprob lookups. Filters take
their per-row settings as device tensors and their on/off decisions as host values, so
that none of them reads a device value back (execution/sampler.py: one host sync per step)."""

from __future__ import annotations

import torch

from hotswap.execution.step import SamplingRequest

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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, active: bool) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely one's
    (`active`: some row has min_p > 0)."""
    if not active:
        return logits
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    threshold = logits.amax(dim=-1, keepdim=True) + min_p[:, None].log()
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """top_k [R] (0: off, vocab-wide values already 0); k_max its largest (0: none on)."""
    if not k_max:
        return logits
    values = logits.topk(k_max, dim=-1).values
    kth = values.gather(1, (top_k.clamp(min=1) - 1)[:, None])
    return logits.masked_fill((top_k > 0)[:, None] & (logits < kth), float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, active: bool) -> torch.Tensor:
    if not active:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def restrict_tokens(logits: torch.Tensor, row: int, request: SamplingRequest) -> None:
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


def add_logit_bias(logits: torch.Tensor, row: int, request: SamplingRequest) -> None:
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


def token_stats(
    values: torch.Tensor, tokens: torch.Tensor, k_max: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `values`: the value of `tokens[i]`, its rank (1 = highest), and the row's
    top `k_max` ids and values, as device tensors (read back by the caller)."""
    token_values = values.gather(1, tokens[:, None])
    ranks = (values > token_values).sum(dim=-1) + 1
    if not k_max:
        empty = values.new_empty((values.shape[0], 0))
        return token_values.flatten(), ranks, empty.long(), empty
    top = values.topk(k_max, dim=-1)
    return token_values.flatten(), ranks, top.indices, top.values
