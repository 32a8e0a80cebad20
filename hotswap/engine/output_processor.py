"""Front-end side of generation: detokenizes engine outputs, applies stop strings, folds
the n choices of a request together and shapes `RequestOutput`s per output kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hotswap.detokenizer import IncrementalDetokenizer
from hotswap.engine.messages import EngineCoreOutput, TokenLogprobsMsg
from hotswap.errors import InvalidArgument
from hotswap.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    WeightVersionSpan,
)
from hotswap.sampling_params import RequestOutputKind, SamplingParams
from hotswap.tokenizer import Tokenizer


@dataclass
class ChoiceState:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # tokens already handed out (delta mode)
    spans: list[WeightVersionSpan] = field(default_factory=list)
    routed_experts: list[np.ndarray] = field(default_factory=list)  # rows as they came
    num_prompt_tokens: int = 0
    bf16_logprobs: list[float] | None = None  # return_bf16_logprobs, from the final output
    # A stop string ended it here while the engine still had to score it with the bf16
    # weights: (finish_reason, stop_reason), applied when the engine's final output comes.
    pending_finish: tuple[str, str] | None = None

    def routed_experts_rows(self) -> np.ndarray | None:
        """[prompt + output tokens - 1 - routed_experts_prompt_start, layers, top_k]: every
        position that was fed to the model (the last sampled token never was), as vLLM's."""
        if not self.routed_experts:
            return None
        skipped = self.params.routed_experts_prompt_start  # at most the prompt's length
        rows = self.num_prompt_tokens + len(self.token_ids) - 1 - skipped
        return np.concatenate(self.routed_experts)[: max(rows, 0)]

    def record_provenance(self, out: EngineCoreOutput) -> None:
        end = len(self.token_ids)
        start = end - len(out.new_token_ids)
        if start == end:
            return
        last = self.spans[-1] if self.spans else None
        key = (out.weight_version, out.weight_label, out.stale, out.lora_name, out.lora_version)
        if last is not None and (last.version, last.label, last.stale, last.lora_name,
                                 last.lora_version) == key:  # fmt: skip
            last.end = end
        else:
            self.spans.append(WeightVersionSpan(*key[:2], start, end, *key[2:]))


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[ChoiceState]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class Processed(NamedTuple):
    """What `OutputProcessor.process` gives back: the outputs to deliver; the child ids a
    stop string ended, to abort (`to_stop`: those whose final output, with their bf16
    logprobs, is still awaited: aborted with `stopped`)."""

    outputs: list[RequestOutput]
    to_abort: list[str]
    to_stop: list[str]


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_choice: dict[str, tuple[RequestState, ChoiceState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child id, params) pairs the engine must run."""
        if request_id in self.requests:
            raise InvalidArgument("request_id", f"request_id: {request_id!r} is already in use")
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, [])
        children = []
        for index in range(params.n):
            child_params = params.for_child(index) if params.n > 1 else params
            choice = ChoiceState(index, child_params, self._detokenizer(prompt_token_ids, params))
            choice.num_prompt_tokens = len(prompt_token_ids)
            if params.logprobs is not None:
                choice.logprobs, choice.cumulative_logprob = [], 0.0
            state.choices.append(choice)
            child_id = child_request_id(request_id, index, params.n)
            self.child_to_choice[child_id] = (state, choice)
            children.append((child_id, child_params))
        self.requests[request_id] = state
        return children

    def process(self, outputs: list[EngineCoreOutput]) -> Processed:
        """The request outputs to deliver and the child ids a stop string ended here,
        after the engine produced the token: the engine must abort them."""
        touched: dict[str, RequestState] = {}
        done = Processed([], [], [])
        for out in outputs:
            entry = self.child_to_choice.get(out.request_id)
            if entry is None:
                continue  # already finished here (e.g. stop string) and aborted
            state, choice = entry
            if self._apply(state, choice, out):
                stopped = choice.pending_finish is not None
                (done.to_stop if stopped else done.to_abort).append(out.request_id)
            if choice.finish_reason is not None:
                del self.child_to_choice[out.request_id]
            touched[state.request_id] = state
        done.outputs.extend(r for s in touched.values() if (r := self._make_output(s)) is not None)
        for state in touched.values():
            if state.finished:
                del self.requests[state.request_id]
        return done

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        if state is None:
            return []
        n = len(state.choices)
        return [
            child_request_id(request_id, c.index, n)
            for c in state.choices
            if c.finish_reason is None
        ]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids still running in the engine."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        children = [
            child_request_id(request_id, c.index, len(state.choices)) for c in state.choices
        ]
        for child in children:
            self.child_to_choice.pop(child, None)
        return children

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def _apply(self, state: RequestState, choice: ChoiceState, out: EngineCoreOutput) -> bool:
        """Fold one engine output into a choice; True if a stop string just ended it."""
        if choice.pending_finish is not None:  # stopped: only its bf16 logprobs are awaited
            if out.finished:
                choice.finish_reason, choice.stop_reason = choice.pending_finish
                choice.bf16_logprobs = (out.bf16_logprobs or [])[: len(choice.token_ids)]
            return False
        if out.bf16_logprobs is not None:
            choice.bf16_logprobs = out.bf16_logprobs
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = self._prompt_logprobs(state.prompt_token_ids, out)
        choice.token_ids.extend(out.new_token_ids)
        choice.record_provenance(out)
        if out.routed_experts is not None:
            choice.routed_experts.append(out.routed_experts.array())
        if out.new_logprobs and choice.logprobs is not None:
            for token, lp in zip(out.new_token_ids, out.new_logprobs):
                choice.logprobs.append(self._logprob_dict(token, lp))
                choice.cumulative_logprob += lp.token_logprob
        check_stop = len(choice.token_ids) >= choice.params.min_tokens
        stop_str = choice.detokenizer.update(out.new_token_ids, check_stop=check_stop)
        if stop_str is not None and out.finish_reason is None:
            if choice.params.return_bf16_logprobs:  # the engine scores it as it aborts it
                choice.pending_finish = ("stop", stop_str)
            else:
                choice.finish_reason, choice.stop_reason = "stop", stop_str
            return True
        if stop_str is not None:
            choice.finish_reason, choice.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _prompt_logprobs(self, prompt_ids: list[int], out: EngineCoreOutput) -> PromptLogprobs:
        scored = out.prompt_logprobs or []
        return [None, *(self._logprob_dict(t, lp) for t, lp in zip(prompt_ids[1:], scored))]

    def _logprob_dict(self, token: int, lp: TokenLogprobsMsg) -> dict[int, Logprob]:
        entries = {
            tid: Logprob(value, rank + 1, self.tokenizer.decode([tid], skip_special_tokens=False))
            for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs))
        }
        if token not in entries:
            entries[token] = Logprob(
                lp.token_logprob,
                lp.token_rank,
                self.tokenizer.decode([token], skip_special_tokens=False),
            )
        return entries

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        # The first choice scores the prompt; others may start sooner (they can use the
        # prefix cache). Hold every output until the scores are there to go first.
        scores_pending = state.params.prompt_logprobs is not None and state.prompt_logprobs is None
        if scores_pending and not state.finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [self._completion(c, delta) for c in state.choices]
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _completion(choice: ChoiceState, delta: bool) -> CompletionOutput:
        finished = choice.finish_reason is not None
        if delta:
            start, choice.sent_tokens = choice.sent_tokens, len(choice.token_ids)
            text = choice.detokenizer.get_delta(finished)
        else:
            start, text = 0, choice.detokenizer.output_text
        return CompletionOutput(
            index=choice.index,
            text=text,
            token_ids=choice.token_ids[start:],
            logprobs=None if choice.logprobs is None else choice.logprobs[start:],
            cumulative_logprob=choice.cumulative_logprob,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            weight_versions=_clip_spans(choice.spans, start),
            routed_experts=choice.routed_experts_rows() if finished else None,
            bf16_logprobs=choice.bf16_logprobs if finished else None,
        )


def _clip_spans(spans: list[WeightVersionSpan], start: int) -> list[WeightVersionSpan]:
    """Copies of the spans covering output tokens from `start` on (indexes stay absolute)."""
    return [dataclasses.replace(s, start=max(s.start, start)) for s in spans if s.end > start]
