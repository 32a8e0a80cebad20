"""The engine-side request: owns its tokens, its KV blocks and its progress."""

from __future__ import annotations

import enum
import time

import numpy as np
import torch

from hotswap.lora.adapter import AdapterWeights
from hotswap.multimodal.placement import ImagePlacement
from hotswap.sampling_params import SamplingParams
from hotswap.structured_output import GrammarMatcher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # evicted by recompute; back in the waiting queue with its output kept
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Tokens are tracked as computed vs known rather than as prefill/decode phases:
    each step computes KV for `all_token_ids[num_computed_tokens:]` (or a chunk of it), and
    a token is sampled once every known token has been computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_retention_s: float = 0.0,
        images: ImagePlacement | None = None,
    ) -> None:
        self.request_id = request_id
        self.images = images  # its prompt's images: placeholders, pixels, M-RoPE positions
        # Seconds its blocks are kept after it finishes, for its session's next turn (soft)
        self.kv_retention_s = kv_retention_s
        # --scheduling-policy priority: lower first (vLLM's); `arrival_order` breaks ties of
        # (priority, arrival_time), set by the scheduler when it adds the request.
        self.priority = priority
        self.arrival_order = 0
        self.cache_salt = cache_salt  # prefix-cache blocks are shared only within one salt
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of tokens
        self.block_hashes_version = 0  # the weight version those hashes are salted with
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not yet
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Weight versions: the one its first token came from (staleness bound) and the one
        # its KV cache was computed with (tokens decoded after a newer commit are stale).
        self.start_version: int | None = None
        self.kv_version = 0
        self.generator = _make_generator(sampling_params.seed)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # Entry j scores prompt token j + 1 (the runner's TokenLogprobs); sent once, with
        # the first output token.
        self.prompt_logprobs: list = []
        self.prompt_logprobs_sent = False
        # Structured outputs: the grammar's position, advanced by every appended token
        # (set by the engine core when the request asks for a constraint).
        self.grammar: GrammarMatcher | None = None
        # The LoRA adapter version it runs on (set by the engine core at admission; None:
        # the base model). Held to the end, whatever is loaded under its name meanwhile.
        self.lora: AdapterWeights | None = None
        # Routing replay (--enable-return-routed-experts): the experts of positions
        # [.., routed_experts_end) have been read; `routed_experts` holds the rows not
        # sent yet. Kept across preemption: a recomputed position keeps the experts that
        # produced the token after it.
        self.routed_experts: list[np.ndarray] = []
        self.routed_experts_end = 0
        # return_bf16_logprobs (engine/scoring.py): each token's sampled logprob, and its
        self.sampled_logprobs: list[float] = []
        self.bf16_logprobs: list[float] | None = None  # under the bf16 weights, at finish

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens still to be scored: their positions must be computed, not taken
        from the prefix cache."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def routed_experts_start(self) -> int:
        """The first position whose experts are still to be read."""
        return max(self.routed_experts_end, self.sampling_params.routed_experts_prompt_start)

    def add_routed_experts(self, rows: np.ndarray) -> None:
        """Rows read from `routed_experts_start` on."""
        self.routed_experts_end = self.routed_experts_start + len(rows)
        self.routed_experts.append(rows)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def reset_for_recompute(self) -> None:
        """Forget computed KV (preemption, cache drop); the tokens themselves are kept.
        Before the first output token the routed experts read so far are forgotten too
        (never sent: they ride on outputs): no token came from them, and the first one
        will come from the recomputed positions, maybe under newer weights."""
        self.num_computed_tokens = 0
        self.block_ids = []
        if not self.output_token_ids:
            self.routed_experts = []
            self.routed_experts_end = 0

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


def _make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
