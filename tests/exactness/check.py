"""What the engine returned for one choice, and its check against the reference.

For every token whose span is not stale: its logprob equals the reference's log-softmax
at that position within `Tolerances.logprob`, and under greedy decoding the token is the
reference's argmax (or within `Tolerances.tie` of it: float32 summation order may flip an
exact tie, which is counted, never silently); the weights are those of the version its span
names (and the LoRA adapter version), so a token labelled with the wrong version fails
here. For a mixture of experts every row of routed experts equals the reference router's
top-k under the weights that produced the token after that position.

Not checked against the reference: stale tokens (a pause with clear_cache=False, a disk
reload or relabel while running, or kv_policy "keep" across a commit). Their context's KV
was computed under older weights at positions no output names (a prefill chunk or a
recompute can straddle the commit), so no independent reference can be built from the
outputs; README documents them as not token-exact. Their spans are still checked
(contiguous, monotonic, committed versions only, never older than the request).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tests.exactness.reference import Reference, Scored
from tests.exactness.schedule import Submit
from tests.exactness.weights import Ledger


@dataclass(frozen=True)
class Tolerances:
    logprob: float  # |engine - reference| a token's logprob may differ by
    tie: float  # reference logprob gap under which either token is a correct argmax
    expert_tie: float  # router probability gap under which experts may swap


EXACT = Tolerances(logprob=1e-5, tie=5e-5, expert_tie=1e-5)
# An FP8 KV cache: the reference quantizes its keys and values as the cache does, but a
# value within float32 rounding of an e4m3 rounding boundary may land on the neighbouring
# code (one step: 1/8 of its magnitude) on one side and not the other: seen up to 2e-3 in
# a token's logprob over ~40k tokens. Looser, yet a reference over unquantized K/V already
# differs by 4e-2, and a stale or misplaced KV entry by more.
FP8_KV = Tolerances(logprob=5e-3, tie=1e-2, expert_tie=5e-3)


@dataclass(frozen=True)
class Span:
    version: int
    start: int
    end: int
    stale: bool
    lora_name: str | None = None
    lora_version: int | None = None


@dataclass(frozen=True, eq=False)
class Observed:
    """One choice of one request, as the engine returned it, with what the driver knew
    when it was submitted."""

    request: Submit
    index: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    spans: tuple[Span, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    text: str
    experts: np.ndarray | None
    experts_expected: bool  # the route returns routed experts (a mixture of experts)
    submitted_version: int  # the committed version when it was submitted
    may_abort: bool  # an abort-mode pause or sleep came after its submission
    lora_name: str | None  # the adapter name it ran on

    @property
    def name(self) -> str:
        return f"{self.request.key}[{self.index}]"


@dataclass(frozen=True)
class Failure:
    kind: str  # token | logprob | version | experts | finish | round | error | hang
    message: str


@dataclass
class Tally:
    tokens: int = 0  # checked against the reference (logprob, and argmax if greedy)
    greedy: int = 0
    stale: int = 0  # carried stale KV: spans checked, not the reference
    near_ties: int = 0
    expert_rows: int = 0
    events: Counter[str] = field(default_factory=Counter)  # what the schedules covered

    def add(self, other: Tally) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def observe(self, obs: Observed) -> None:
        """Count what a checked choice went through."""
        events = self.events
        events["choices"] += 1
        events[f"choices ended {obs.finish_reason}"] += 1
        events["choices across versions"] += len({s.version for s in obs.spans}) > 1
        events["choices with stale tokens"] += any(s.stale for s in obs.spans)
        events["choices on an adapter"] += obs.lora_name is not None
        events["sampled choices"] += obs.request.seed is not None
        events["choices with a priority"] += obs.request.priority != 0
        events["choices with KV retained"] += obs.request.kv_retention_s > 0


@dataclass(frozen=True)
class Context:
    """What a check needs besides the choice."""

    arch: str
    ledger: Ledger
    reference: Reference
    eos_token_id: int
    max_model_len: int
    kv_fp8: bool = False  # the engine's KV cache is FP8: the reference reads K/V quantized

    @property
    def tolerances(self) -> Tolerances:
        return FP8_KV if self.kv_fp8 else EXACT


def check_choice(obs: Observed, ctx: Context, tally: Tally) -> list[Failure]:
    failures = check_finish(obs, ctx) + check_spans(obs, ctx)
    if failures:
        return failures
    failures = check_tokens(obs, ctx, tally)
    if obs.experts_expected and obs.tokens:
        failures += check_experts(obs, ctx, tally)
    tally.observe(obs)
    return failures


def check_finish(obs: Observed, ctx: Context) -> list[Failure]:
    req, n = obs.request, len(obs.tokens)
    reason, fail = obs.finish_reason, []
    if reason is None:
        fail.append(f"{obs.name} never finished ({n} tokens)")
    elif reason == "abort" and not obs.may_abort:
        fail.append(f"{obs.name} aborted after {n} tokens with no abort-mode pause or sleep")
    elif reason == "length" and n != req.max_tokens and len(obs.prompt) + n < ctx.max_model_len:
        fail.append(f"{obs.name} ended 'length' at {n} of max_tokens {req.max_tokens}")
    elif reason == "stop" and obs.stop_reason is None and (req.ignore_eos or not obs.tokens):
        fail.append(f"{obs.name} ended 'stop' without a stop string, ignoring eos")
    elif reason == "stop" and obs.stop_reason is None and obs.tokens[-1] != ctx.eos_token_id:
        fail.append(f"{obs.name} ended 'stop' on token {obs.tokens[-1]}, not eos")
    elif reason == "stop" and obs.stop_reason is not None and obs.stop_reason not in req.stop:
        fail.append(f"{obs.name} stopped on {obs.stop_reason!r}, not one of {list(req.stop)}")
    if reason == "length" and any(s in obs.text for s in req.stop):
        fail.append(f"{obs.name} ran to 'length' past a stop string: {obs.text!r}")
    if n > req.max_tokens:
        fail.append(f"{obs.name} has {n} tokens, more than max_tokens {req.max_tokens}")
    if obs.logprobs is None or len(obs.logprobs) != n:
        fail.append(f"{obs.name}: {n} tokens but logprobs {obs.logprobs!r}")
    return [Failure("finish", message) for message in fail]


def check_spans(obs: Observed, ctx: Context) -> list[Failure]:
    """Spans cover the tokens in order, with committed, known, non-decreasing versions no
    older than the request, on the request's adapter, one adapter version throughout."""
    fail, end, last = [], 0, obs.submitted_version
    for span in obs.spans:
        where = f"{obs.name} span {span}"
        if span.start != end or span.end <= span.start:
            fail.append(f"{where}: does not continue at token {end}")
        if span.version < last:
            fail.append(f"{where}: version older than {last}")
        state = ctx.ledger.versions.get(span.version)
        if state is None or state.tensors is None:
            fail.append(f"{where}: version never committed with complete weights")
        if span.lora_name != obs.lora_name:
            fail.append(f"{where}: ran on adapter {obs.lora_name!r}")
        elif span.lora_name and (span.lora_name, span.lora_version) not in ctx.ledger.adapters:
            fail.append(f"{where}: adapter version never loaded")
        end, last = span.end, span.version
    if end != len(obs.tokens):
        fail.append(f"{obs.name}: spans end at {end}, tokens at {len(obs.tokens)}")
    if len({s.lora_version for s in obs.spans}) > 1:
        fail.append(f"{obs.name}: adapter version changed mid-request: {obs.spans}")
    return [Failure("version", message) for message in fail]


def span_of(obs: Observed, index: int) -> Span:
    return next(s for s in obs.spans if s.start <= index < s.end)


def score(obs: Observed, ctx: Context, span: Span) -> Scored:
    state = ctx.ledger.versions[span.version]
    adapter = ctx.ledger.adapters.get((span.lora_name, span.lora_version))
    sequence = obs.prompt + obs.tokens[:-1]
    return ctx.reference.score(ctx.arch, state, adapter, sequence, ctx.kv_fp8)


def check_tokens(obs: Observed, ctx: Context, tally: Tally) -> list[Failure]:
    greedy = obs.request.seed is None
    for index, token in enumerate(obs.tokens):
        span = span_of(obs, index)
        if span.stale:
            tally.stale += 1
            continue
        row = score(obs, ctx, span).logprobs[len(obs.prompt) - 1 + index]
        expected, got = float(row[token]), obs.logprobs[index]
        tally.tokens += 1
        where = (
            f"{obs.name} token {index} (version {span.version}, "
            f"{ctx.ledger.how.get(span.version)}{_adapter(span)})"
        )
        if abs(got - expected) > ctx.tolerances.logprob:
            return [
                Failure(
                    "logprob",
                    f"{where}: token {token} logprob {got:.7f}, reference {expected:.7f} "
                    f"(reference argmax {int(row.argmax())})",
                )
            ]
        if not greedy:
            continue
        tally.greedy += 1
        best = int(row.argmax())
        if token != best:
            gap = float(row[best]) - expected
            if gap > ctx.tolerances.tie:
                message = f"{where}: greedy token {token}, reference argmax {best} (gap {gap:.2e})"
                return [Failure("token", message)]
            tally.near_ties += 1
    return []


def _adapter(span: Span) -> str:
    return "" if span.lora_name is None else f", {span.lora_name} v{span.lora_version}"


def check_experts(obs: Observed, ctx: Context, tally: Tally) -> list[Failure]:
    """Row p was fed to produce the token after it, and its weights are that token's;
    prompt rows are those of the forward the first token came from (a prefill whose KV
    was dropped before the first token, by a pause with clear_cache or a recompute,
    returns the recomputed rows)."""
    rows, prompt = obs.experts, len(obs.prompt)
    expected_rows = prompt + len(obs.tokens) - 1
    if rows is None or rows.shape[0] != expected_rows:
        shape = None if rows is None else rows.shape
        return [Failure("experts", f"{obs.name}: routed experts {shape}, {expected_rows} rows")]
    first = span_of(obs, 0)
    for position in range(expected_rows):
        index = position + 1 - prompt
        span = span_of(obs, index) if index >= 0 else first
        if span.stale:
            continue
        tally.expert_rows += 1
        scored = score(obs, ctx, span)
        if not _experts_match(rows[position], scored, position, ctx.tolerances.expert_tie):
            fed = f"token {index}" if index >= 0 else f"prompt token {position + 1}"
            message = (
                f"{obs.name} routed experts at position {position} (producing {fed}, "
                f"version {span.version}): engine {rows[position].tolist()}, reference "
                f"{scored.experts[position].tolist()}"
            )
            return [Failure("experts", message)]
    return []


def _experts_match(row: np.ndarray, scored: Scored, position: int, tie: float) -> bool:
    got, want = row.astype(np.int64), scored.experts[position]
    if np.array_equal(got, want):
        return True
    probs = scored.router_probs[position]  # [layers, experts]
    for layer in range(got.shape[0]):
        ranked_got = probs[layer, got[layer]]
        ranked_want = probs[layer, want[layer]]
        if np.abs(ranked_got - ranked_want).max() > tie:
            return False
    return True
