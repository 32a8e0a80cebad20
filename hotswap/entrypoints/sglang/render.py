"""The engine side of SGLang's POST /generate: one engine request per prompt (each with its
own SamplingParams, as SGLang takes one per prompt), and each output item rendered in
SGLang's shape: {"text", "output_ids", "meta_info": {...}}, cumulative in every streamed
chunk as SGLang streams by default.

SGLang's shapes (python/sglang/srt/managers/tokenizer_manager.py `_handle_batch_output`,
scheduler_output_processor_mixin.py, schedule_batch.py finish reasons,
utils/weight_versions.py):
- finish_reason: {"type": "stop", "matched": token id | str}, {"type": "length",
  "length": n}, {"type": "abort", "message", "status_code", "err_type"}; null until done.
- output_token_logprobs: [[logprob, token id, text or null], ...]; input_token_logprobs
  covers the prompt from logprob_start_len on, its first entry's logprob always null.
- weight_version: a label; weight_versions: spans [{"version": label, "start", "end"}].
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.params import EnginePrompt
from hotswap.entrypoints.openai.responses import sglang_routed_experts
from hotswap.entrypoints.openai.serving import MergedStream, clamp_logprob
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput, WeightVersionSpan
from hotswap.sampling_params import SamplingParams
from hotswap.tokenizer import Tokenizer

ABORT_MESSAGE = "Aborted by the server (abort request, pause or weight lag)"

_DONE = object()


@dataclass(frozen=True)
class LogprobSpec:
    """What return_logprob asks for one prompt: prompt positions from `start` on (already
    resolved from SGLang's -1, "the last prompt token only"), `top` alternatives per
    position, tokens' text or null."""

    start: int
    top: int
    with_text: bool


@dataclass
class Job:
    """One prompt of the request: one engine request; its n samples are the children."""

    prompt: EnginePrompt
    params: SamplingParams
    request_id: str
    logprobs: LogprobSpec | None  # None: return_logprob false
    # max_new_tokens 0 (scoring a prompt): the engine samples one token, never returned
    prefill_only: bool = False
    no_stop_trim: bool = False
    routed_experts: bool = False  # return_routed_experts


def job_stream(engine: AsyncLLM, jobs: Sequence[Job]) -> MergedStream:
    """One `engine.generate` per job (each with its own SamplingParams), merged in
    arrival order as (job index, output), as on the OpenAI routes."""
    return MergedStream(
        engine, [j.prompt for j in jobs], [j.params for j in jobs], [j.request_id for j in jobs]
    )


@dataclass
class ItemState:
    """One output item (one of its job's n samples) as generated so far. Logprob entries
    are rendered as they arrive, so a cumulative chunk costs no re-rendering."""

    job: Job
    item_id: str
    started: float  # time.monotonic() when the HTTP request arrived
    tokenizer: Tokenizer
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[list[Any]] = field(default_factory=list)
    top_logprobs: list[list[list[Any]] | None] = field(default_factory=list)
    spans: list[WeightVersionSpan] = field(default_factory=list)
    routed_experts: np.ndarray | None = None  # on the final output
    bf16_logprobs: list[float] | None = None  # return_bf16_logprobs, on the final output
    label: str | None = None  # of the weights behind the latest token, returned or not
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    input_logprobs: list[list[Any]] | None = None
    input_top: list[list[list[Any]] | None] | None = None
    latency: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, output: RequestOutput, delta: CompletionOutput) -> None:
        """Fold in what is new in `delta` (all of it for a final-only output)."""
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        if self.input_logprobs is None:
            self._add_input_logprobs(output)
        for span in delta.weight_versions:
            self.label = span.label
        if not self.job.prefill_only:
            self._add_tokens(delta)
        if delta.finish_reason is not None:
            self.routed_experts, self.bf16_logprobs = delta.routed_experts, delta.bf16_logprobs
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.latency = time.monotonic() - self.started
            if self._trims_stop_token():
                skip = self.job.params.skip_special_tokens
                last = self.tokenizer.decode(self.output_ids[-1:], skip_special_tokens=skip)
                if last and self.text.endswith(last):
                    self.text = self.text[: -len(last)]

    def _add_tokens(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.output_ids.extend(delta.token_ids)
        _merge_spans(self.spans, delta.weight_versions)
        spec = self.job.logprobs
        if spec is None or delta.logprobs is None:
            return
        for token, entries in zip(delta.token_ids, delta.logprobs):
            self.token_logprobs.append(_entry(token, entries.get(token), spec.with_text))
            if spec.top > 0:
                self.top_logprobs.append(_top(entries, spec.top, spec.with_text))

    def _trims_stop_token(self) -> bool:
        """SGLang cuts a matched stop token (EOS or stop_token_ids) from the text unless
        no_stop_trim; hotswap's detokenizer keeps its text (empty for a skipped special
        token). The ids keep it either way, in both engines."""
        return (
            self.finish_reason == "stop"
            and not isinstance(self.stop_reason, str)
            and not self.job.no_stop_trim
            and bool(self.output_ids)
        )

    def _add_input_logprobs(self, output: RequestOutput) -> None:
        spec = self.job.logprobs
        ids = output.prompt_token_ids
        if spec is None:
            return
        first_text = None
        if spec.with_text:
            first_text = self.tokenizer.decode([ids[spec.start]], skip_special_tokens=False)
        first = [None, ids[spec.start], first_text]  # SGLang never scores its first entry
        if spec.start == len(ids) - 1:
            self.input_logprobs, self.input_top = [first], [None]
            return
        scored = output.prompt_logprobs
        if scored is None:
            return  # they come with the first output; an abort before it has none
        self.input_logprobs, self.input_top = [first], [None]
        for i in range(spec.start + 1, len(ids)):
            entries = scored[i] or {}
            self.input_logprobs.append(_entry(ids[i], entries.get(ids[i]), spec.with_text))
            self.input_top.append(_top(entries, spec.top, spec.with_text))

    def render(self, index: int | None, with_prompt_ids: bool) -> dict[str, Any]:
        """The item as SGLang returns it; `index`: its place in a streamed batch."""
        item: dict[str, Any] = {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self._meta_info(),
        }
        if with_prompt_ids:
            item["prompt_token_ids"] = list(self.job.prompt.token_ids)
        if index is not None:
            item["index"] = index
        return item

    def _meta_info(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.item_id,
            "finish_reason": self._finish_json(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.label,
            # SGLang's per-token provenance spans (version = the label), with hotswap's
            # committed version number and staleness (KV from older weights) added.
            "weight_versions": [_span_json(s) for s in self.spans],
        }
        spec = self.job.logprobs
        if spec is not None:
            meta["input_token_logprobs"] = self.input_logprobs or []
            meta["output_token_logprobs"] = self.token_logprobs
            if spec.top > 0:
                meta["input_top_logprobs"] = self.input_top or []
                meta["output_top_logprobs"] = self.top_logprobs
        if self.job.routed_experts and self.routed_experts is not None:
            meta["routed_experts"] = sglang_routed_experts(self.routed_experts)
        if self.bf16_logprobs is not None:
            meta["bf16_logprobs"] = self.bf16_logprobs
        if self.latency is not None:
            meta["e2e_latency"] = self.latency
        return meta

    def _finish_json(self) -> dict[str, Any] | None:
        reason = self.finish_reason
        if reason is None:
            return None
        if reason == "abort":
            message = f"{ABORT_MESSAGE}: {self.stop_reason}" if self.stop_reason else ABORT_MESSAGE
            return {"type": "abort", "message": message, "status_code": None, "err_type": None}
        if reason == "length" or self.job.prefill_only:
            return {"type": "length", "length": len(self.output_ids)}
        matched = self.stop_reason  # a stop string or stop token id; None: the EOS token
        if matched is None and self.output_ids:
            matched = self.output_ids[-1]
        return {"type": "stop", "matched": matched}


def _entry(token: int, logprob: Logprob | None, with_text: bool) -> list[Any]:
    value = None if logprob is None else clamp_logprob(logprob.logprob)
    text = logprob.decoded_token if with_text and logprob is not None else None
    return [value, token, text]


def _top(entries: dict[int, Logprob], k: int, with_text: bool) -> list[list[Any]] | None:
    """The k most likely tokens, most likely first (the entries also hold the sampled or
    prompt token, ranked below k when it is not among them)."""
    if k <= 0:
        return None
    ranked = sorted(
        ((lp.rank, token, lp) for token, lp in entries.items() if lp.rank and lp.rank <= k),
        key=lambda item: item[0],
    )
    return [_entry(token, lp, with_text) for _, token, lp in ranked]


def _span_json(span: WeightVersionSpan) -> dict[str, Any]:
    found: dict[str, Any] = {"version": span.label, "start": span.start, "end": span.end,
                             "committed_version": span.version, "stale": span.stale}  # fmt: skip
    if span.lora_name is not None:  # the adapter that produced them, and its version
        found |= {"lora_name": span.lora_name, "lora_version": span.lora_version}
    return found


def _merge_spans(spans: list[WeightVersionSpan], new: Sequence[WeightVersionSpan]) -> None:
    """Append a delta's spans (absolute token indexes), joining a span that continues the
    last one on the same weights."""
    for span in new:
        last = spans[-1] if spans else None
        if (
            last is not None
            and (last.version, last.stale, last.lora_version)
            == (span.version, span.stale, span.lora_version)
            and last.end >= span.start
        ):
            last.end = max(last.end, span.end)
        else:
            spans.append(dataclasses.replace(span))


async def fill_missing_labels(engine: AsyncLLM, items: Sequence[ItemState]) -> None:
    """An item that finished without a token (aborted while queued) has seen no weights:
    report the engine's current label, as SGLang reports its server's."""
    if all(item.label is not None or not item.finished for item in items):
        return
    try:
        label = (await engine.get_weight_version())["label"]
    except Exception:  # noqa: BLE001 - the label is informative; the result still goes out
        return
    for item in items:
        if item.label is None and item.finished:
            item.label = label
