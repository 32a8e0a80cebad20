"""Random schedules: a random engine and a random mix of requests and boundaries.

Requests have prompts of random lengths (some exactly whole KV blocks, some sharing a
prefix with earlier ones so the prefix cache hits, the special ids 0, 1 and 2 — the pad
id among them — inside), `max_tokens` from 1, `n` up to 3, stop strings, greedy or seeded
sampling, LoRA adapters. Between them: pauses in every mode with and without
clear_cache (rounds and new requests inside), weight rounds of every kind with or without
a pause (in flight when the engine receives so), sleeps at every level and wakes, adapter
loads and reloads. Engines vary block size, KV blocks (few: preemption), the batched
token budget (small: chunked prefill), backend, in-flight rounds, the double buffer and
the KV policy. Over HTTP the engine is one of `HTTP_SPECS` (each a server to start).

Invariant: a schedule is a pure function of the generator's random state.
"""

from __future__ import annotations

import random

from tests.exactness.schedule import (
    Await,
    EngineSpec,
    LoadAdapter,
    Pause,
    Resume,
    Round,
    Schedule,
    Sleep,
    Step,
    Submit,
    Wake,
)

VOCAB = 384  # the tiny models' (tests/helpers/tiny_models.py)
SPECIAL = (0, 1, 2)  # <|endoftext|>, <|im_start|>, <|im_end|> (also the pad id)
STOP_STRINGS = ("e", " a", "o", "in", "t", "s ")
HTTP_SPECS = (
    EngineSpec("llama", 8, 12, 16, "ipc", in_flight=True, double_buffer=True,
               kv_policy="recompute", lora=True),
    EngineSpec("qwen3_moe", 4, 24, 24, "sparse"),
)  # fmt: skip
ROUND_KINDS = {  # kind -> weight, per backend
    "ipc": {"whole": 3, "partial": 3, "disk": 2, "aborted": 2, "relabel": 1},
    "sparse": {"sparse": 4, "whole": 2, "disk": 2, "aborted": 1, "relabel": 1},
}


def random_schedule(
    rng: random.Random, transport: str = "python", spec: EngineSpec | None = None
) -> Schedule:
    """`spec`: the engine to use (over HTTP, one of HTTP_SPECS; default: a random one)."""
    if spec is None:
        spec = rng.choice(HTTP_SPECS) if transport == "http" else random_spec(rng)
    return Schedule(spec, tuple(_Builder(rng, spec, transport).build()))


def random_spec(rng: random.Random) -> EngineSpec:
    arch = "qwen3_moe" if rng.random() < 0.3 else "llama"
    block = rng.choice((4, 8, 16))
    tight = rng.random() < 0.5  # few blocks: requests preempt each other
    kv_tokens = rng.choice((64, 96, 128)) if tight else 512
    return EngineSpec(
        arch=arch,
        block_size=block,
        num_kv_blocks=kv_tokens // block,
        max_num_batched_tokens=rng.choice((8, 16, 32)) if rng.random() < 0.5 else 2048,
        backend="sparse" if rng.random() < 0.25 else "ipc",
        in_flight=rng.random() < 0.3,
        double_buffer=rng.random() < 0.3,
        kv_policy=rng.choice(("keep", "recompute")),
        lora=arch == "llama" and rng.random() < 0.35,
        fp8=rng.random() < 0.25,
        kv_fp8=rng.random() < 0.2,
        scheduling_policy="priority" if rng.random() < 0.3 else "fcfs",
    )


class _Builder:
    def __init__(self, rng: random.Random, spec: EngineSpec, transport: str) -> None:
        self.rng, self.spec, self.transport = rng, spec, transport
        self.steps: list[Step] = []
        self.submitted: list[Submit] = []
        block = spec.block_size
        lengths = [block, 2 * block, rng.randint(3, 20)]
        self.prefixes = [self._tokens(rng.choice(lengths)) for _ in range(2)]

    def build(self) -> list[Step]:
        rng = self.rng
        for _ in range(rng.randint(1, 4)):
            self.submit()
        for _ in range(rng.randint(1, 4)):
            self.await_some()
            self.event()
            for _ in range(rng.randint(0, 2)):
                self.submit()
        return self.steps

    # -- requests -------------------------------------------------------------------------
    def submit(self) -> None:
        rng, spec = self.rng, self.spec
        prompt = self._prompt()
        room = spec.max_model_len - len(prompt)
        max_tokens = min(room, rng.choice((1, rng.randint(1, 8), rng.randint(8, 32))))
        request = Submit(
            key=f"r{len(self.submitted)}",
            prompt=prompt,
            max_tokens=max_tokens,
            n=1 if rng.random() < 0.75 else rng.randint(2, 3),
            stop=() if rng.random() < 0.75 else (rng.choice(STOP_STRINGS),),
            seed=None if rng.random() < 0.75 else rng.randrange(1000),
            ignore_eos=rng.random() < 0.8,
            adapter=rng.randrange(2) if spec.lora and rng.random() < 0.5 else None,
            route=self._route(),
            priority=rng.choice((0, 0, 0, -1, 1, 7)),
            kv_retention_s=0.0 if rng.random() < 0.7 else rng.choice((0.5, 60.0)),
        )
        self.submitted.append(request)
        self.steps.append(request)

    def _route(self) -> str:
        if self.transport != "http":
            return "completions"
        share = 0.7 if self.spec.moe else 0.4  # generate carries routed experts
        return "generate" if self.rng.random() < share else "completions"

    def _prompt(self) -> tuple[int, ...]:
        rng, block = self.rng, self.spec.block_size
        prefix = list(rng.choice(self.prefixes)) if rng.random() < 0.5 else []
        if rng.random() < 0.4:  # fills whole KV blocks exactly
            length = block * rng.randint(1, 4)
        else:
            length = len(prefix) + rng.randint(1, 24)
        tokens = (prefix + self._tokens(length))[: max(length, 1)]
        if rng.random() < 0.3:
            tokens[rng.randrange(len(tokens))] = 0
        return tuple(tokens[: self.spec.max_model_len - 1])

    def _tokens(self, length: int) -> list[int]:
        rng = self.rng
        return [
            rng.choice(SPECIAL) if rng.random() < 0.08 else rng.randrange(3, VOCAB)
            for _ in range(length)
        ]

    def await_some(self) -> None:
        if self.submitted:
            request = self.rng.choice(self.submitted)
            tokens = self.rng.randint(1, max(1, request.max_tokens - 1))
            self.steps.append(Await(request.key, tokens))

    # -- boundaries -----------------------------------------------------------------------
    def event(self) -> None:
        rng = self.rng
        choices = ["pause"] * 5 + ["round"] * 3 + ["sleep"] * 1 + ["none"]
        if self.spec.lora:
            choices += ["adapter"] * 2
        kind = rng.choice(choices)
        if kind == "pause":
            self.pause()
        elif kind == "round":
            self.steps.append(self._round())
        elif kind == "sleep":
            self.sleep()
        elif kind == "adapter":
            self.steps.append(LoadAdapter(rng.randrange(2), rng.randrange(3)))

    def pause(self) -> None:
        rng = self.rng
        self.steps.append(Pause(rng.choice(("abort", "wait", "keep")), rng.random() < 0.5))
        for _ in range(rng.choice((0, 1, 1, 2))):
            self.steps.append(self._round())
        if rng.random() < 0.3:
            self.submit()  # queued while paused
        self.steps.append(Resume())

    def _round(self) -> Round:
        rng = self.rng
        weights = ROUND_KINDS[self.spec.backend]
        kind = rng.choices(list(weights), list(weights.values()))[0]
        policy = None
        if self.spec.backend == "ipc" and kind in ("whole", "partial") and rng.random() < 0.5:
            policy = rng.choice(("keep", "recompute"))
        return Round(kind, rng.randrange(1, 1000), policy)

    def sleep(self) -> None:
        rng = self.rng
        level = rng.choice((0, 1, 2))
        self.steps.append(Sleep(level, rng.choice(("abort", "wait", "keep"))))
        if rng.random() < 0.3:
            self.submit()  # queued while asleep
        self.steps.append(Wake())
        if level == 2 and rng.random() < 0.8:  # weights come back from a checkpoint
            self.steps.append(Round(rng.choice(("disk", "whole")), rng.randrange(1, 1000)))
        if rng.random() < 0.7:
            self.steps.append(Resume())
