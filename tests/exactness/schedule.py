"""A schedule: an engine configuration and the steps a driver plays against it, in order.

Invariants: every element is a frozen dataclass of plain values (a schedule is hashable,
printable and round-trips through JSON, so a failing one can be replayed); a step never
holds engine state, only what to do; any subsequence of a schedule's steps is again a
schedule the driver can play (a step that makes no sense where it lands, e.g. waiting on
a request that was never submitted or waking an engine that is awake, is skipped), which
is what lets the shrinker drop steps freely.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineSpec:
    """The engine: batch-invariant, float32, prefix caching on, sleep mode on, always."""

    arch: str = "llama"  # "llama" or "qwen3_moe" (routed experts returned)
    block_size: int = 8
    num_kv_blocks: int = 64  # few blocks: preemption
    max_num_batched_tokens: int = 2048  # small: chunked prefill
    backend: str = "ipc"  # the trainer's rounds: "ipc" (whole tensors) or "sparse" (deltas)
    in_flight: bool = False  # rounds received beside the steps
    double_buffer: bool = False  # rounds written into a shadow copy, swapped at the commit
    kv_policy: str = "keep"  # what a commit does to running requests' KV by default
    lora: bool = False  # LoRA adapters (dense models only)
    fp8: bool = False  # FP8 linear weights (16 x 16 blocks), quantized on load and receipt
    kv_fp8: bool = False  # an FP8 KV cache (e4m3, scale 1): checked within looser tolerances
    scheduling_policy: str = "fcfs"  # or "priority": admission by the requests' priority

    @property
    def max_model_len(self) -> int:
        return min(self.num_kv_blocks * self.block_size, 512)

    @property
    def moe(self) -> bool:
        return self.arch != "llama"


@dataclass(frozen=True)
class Submit:
    """A request, streamed in the background from here on. `seed` None: greedy; otherwise
    sampled at temperature 1 with that seed (its tokens are not greedy: only their
    logprobs, versions and experts are checked). `adapter`: the LoRA slot it runs on.
    `route` (HTTP only): "completions" (the OpenAI client) or "generate" (token in/out,
    which carries routed experts on streams)."""

    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = True
    adapter: int | None = None
    route: str = "completions"
    priority: int = 0  # vLLM's (lower first under the priority policy)
    kv_retention_s: float = 0.0  # its KV kept this long after it finishes


@dataclass(frozen=True)
class Await:
    """Wait until request `key` has `tokens` tokens in some choice, or has finished."""

    key: str
    tokens: int


@dataclass(frozen=True)
class Pause:
    mode: str  # "abort" | "wait" | "keep"
    clear_cache: bool


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class Round:
    """A weight commit. `kind`: "disk" (reload a checkpoint directory), "whole" / "partial"
    / "sparse" (a trainer's round: every tensor of another checkpoint, some of them, or a
    few perturbed elements of a few tensors), "aborted" (a trainer's round that stages
    tensors, then aborts: nothing may change), "relabel" (update_weight_version: a new
    version of the same weights). `seed` picks the checkpoint, tensors and elements;
    `kv_policy` (trainer rounds): this round's choice, None for the engine's."""

    kind: str
    seed: int = 1
    kv_policy: str | None = None


@dataclass(frozen=True)
class Sleep:
    level: int  # 0: scheduling; 1: also KV and weights offloaded; 2: weights discarded
    mode: str  # the pause mode it sleeps with


@dataclass(frozen=True)
class Wake:
    pass


@dataclass(frozen=True)
class LoadAdapter:
    """Load adapter file `adapter` under the name of LoRA `slot` (a reload in place when
    that name is loaded already: a new adapter version)."""

    slot: int
    adapter: int


Step = Submit | Await | Pause | Resume | Round | Sleep | Wake | LoadAdapter
STEP_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (Submit, Await, Pause, Resume, Round, Sleep, Wake, LoadAdapter)
}


@dataclass(frozen=True)
class Schedule:
    engine: EngineSpec
    steps: tuple[Step, ...]

    @property
    def requests(self) -> list[Submit]:
        return [s for s in self.steps if isinstance(s, Submit)]

    def describe(self) -> str:
        """Human-readable, one line per step."""
        lines = [f"engine: {describe_engine(self.engine)}"]
        lines += [f"{i:3d}. {describe_step(step)}" for i, step in enumerate(self.steps, 1)]
        return "\n".join(lines)

    def to_json(self) -> str:
        steps = [{"step": type(s).__name__, **_plain(s)} for s in self.steps]
        return json.dumps({"engine": _plain(self.engine), "steps": steps}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data = json.loads(text)
        steps = []
        for raw in data["steps"]:
            fields = dict(raw)
            step_cls = STEP_TYPES[fields.pop("step")]
            steps.append(step_cls(**{k: _tupled(v) for k, v in fields.items()}))
        return cls(EngineSpec(**data["engine"]), tuple(steps))


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _tupled(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def describe_engine(spec: EngineSpec) -> str:
    parts = [
        spec.arch,
        f"block {spec.block_size}",
        f"{spec.num_kv_blocks} KV blocks",
        f"batched tokens {spec.max_num_batched_tokens}",
        f"backend {spec.backend}",
    ]
    if spec.in_flight:
        parts.append(f"in flight (kv_policy {spec.kv_policy})")
    elif spec.kv_policy != "keep":
        parts.append(f"kv_policy {spec.kv_policy}")
    if spec.double_buffer:
        parts.append("double buffer")
    if spec.lora:
        parts.append("LoRA")
    return ", ".join(parts)


def describe_step(step: Step) -> str:
    if isinstance(step, Submit):
        return describe_submit(step)
    if isinstance(step, Await):
        return f"await {step.key} >= {step.tokens} tokens"
    if isinstance(step, Pause):
        return f"pause {step.mode} clear_cache={step.clear_cache}"
    if isinstance(step, Round):
        policy = f" kv_policy={step.kv_policy}" if step.kv_policy else ""
        return f"round {step.kind} (seed {step.seed}){policy}"
    if isinstance(step, Sleep):
        return f"sleep level {step.level} mode {step.mode}"
    if isinstance(step, LoadAdapter):
        return f"load adapter {step.adapter} as lora{step.slot}"
    return type(step).__name__.lower()


def describe_submit(step: Submit) -> str:
    prompt = list(step.prompt)
    shown = str(prompt) if len(prompt) <= 12 else f"{prompt[:10]}... ({len(prompt)} tokens)"
    extras = [f"max_tokens {step.max_tokens}"]
    extras.append("greedy" if step.seed is None else f"sampled seed {step.seed}")
    if step.n > 1:
        extras.append(f"n {step.n}")
    if step.stop:
        extras.append(f"stop {list(step.stop)}")
    if not step.ignore_eos:
        extras.append("stops at eos")
    if step.adapter is not None:
        extras.append(f"lora{step.adapter}")
    if step.route != "completions":
        extras.append(f"route {step.route}")
    if step.priority:
        extras.append(f"priority {step.priority}")
    if step.kv_retention_s:
        extras.append(f"KV kept {step.kv_retention_s:g} s")
    return f"submit {step.key}: prompt {shown}, {', '.join(extras)}"
