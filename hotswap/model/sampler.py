"""Turns the logits of the rows that sample this step into tokens (and logprobs).

Random sampling uses the exponential-race form of categorical sampling (argmax of p / q,
q ~ Exp(1)), so each seeded request draws its noise from its own generator: its samples
depend only on its own logits and seed, never on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotswap.engine.request import Request


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
    requests: list[Request]
    greedy: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R, 1]
    top_k: list[int]
    top_p: torch.Tensor  # [R]
    min_p: torch.Tensor  # [R]
    suppressed: list[tuple[int, list[int]]]  # (row, token ids) banned by min_tokens

    @classmethod
    def from_requests(
        cls, requests: list[Request], device: torch.device | str = "cpu"
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
        )


def _banned_tokens(request: Request) -> list[int]:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = set(request.stop_token_ids)
    if request.eos_token_id is not None:
        banned.add(request.eos_token_id)
    return sorted(banned)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        for row, ids in batch.suppressed:
            logits[row, ids] = float("-inf")
        tokens = logits.max(dim=-1).indices  # same first-max tie rule as argmax, ~2x faster
        if not bool(batch.greedy.all()):
            random_rows = (~batch.greedy).nonzero().flatten()
            sampled = self._sample(logits[random_rows], batch, random_rows.tolist())
            tokens[random_rows] = sampled
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, token_list, batch.requests))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        logits = logits / batch.temperature[rows]
        logits = _apply_top_k(logits, [batch.top_k[r] for r in rows])
        logits = _apply_top_p(logits, batch.top_p[rows])
        probs = torch.softmax(logits, dim=-1)
        probs = _apply_min_p(probs, batch.min_p[rows])
        noise = self._exponential_noise(probs.shape, [batch.requests[r].generator for r in rows])
        return (probs / noise.to(probs.device)).max(dim=-1).indices

    def _exponential_noise(self, shape: torch.Size, generators: list) -> torch.Tensor:  # noqa: ANN001
        """Drawn on the host (where the per-request generators live), so a seed samples
        the same tokens on every device."""
        noise = torch.empty(shape).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return noise

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: list[int], requests: list[Request]
    ) -> list[TokenLogprobs | None]:
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(k is None for k in wanted):
            return [None] * len(requests)
        rows = [i for i, k in enumerate(wanted) if k is not None]
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        results: list[TokenLogprobs | None] = [None] * len(requests)
        for i, row in enumerate(rows):
            lp = logprobs[i]
            token_lp = lp[tokens[row]]
            rank = int((lp > token_lp).sum()) + 1
            top = lp.topk(wanted[row]) if wanted[row] else None
            results[row] = TokenLogprobs(
                token_logprob=float(token_lp),
                token_rank=rank,
                top_ids=top.indices.tolist() if top is not None else [],
                top_logprobs=top.values.tolist() if top is not None else [],
            )
        return results


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
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p.
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    if bool((min_p <= 0.0).all()):
        return probs
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)
