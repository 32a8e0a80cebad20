"""In-flight weight updates against the pause-send-resume loop: the idle time they save.

M streaming greedy requests (ignore_eos, a max_tokens they never reach) run on the default
model (float32) while a trainer (a transformers copy of the same checkpoint, float32)
sends R full rounds over gloo or ipc (`--backend`), alternating its weights between the
original and a slightly perturbed copy so that every round changes them. Configurations
(`--configs`, default paused keep swap; the first is the reference):

- paused: `in_flight` off, as an RL loop does it today: `pause_generation(mode="keep",
  clear_cache=False)`, `send_weights`, `resume_generation`; no step runs in between;
- keep: `in_flight` on, `kv_policy="keep"`, no pause: the streams keep decoding on the
  committed weights while the round is received; running requests keep their KV across
  the switch (later tokens are marked stale);
- swap: as keep, with `double_buffer`: the round is written into a second copy of the
  weights beside the steps and the switch swaps the copies (no model copy between steps);
- recompute: `in_flight` on, `kv_policy="recompute"`, no pause: at the switch running
  requests drop their KV and recompute prompt + output so far under the new weights.

One engine per configuration: an `AsyncLLM(multiprocess=True)` in this process, each
engine core in its own process with its own trainer group, so they are loaded once and the
slots can be interleaved. Only one engine generates at a time: the others are paused
(keep, their requests alive), since three engines decoding at once on a small machine
would share its cores, and a paused engine would speed up the other two. The streams of
an engine run through all of its rounds (their context grows, as a rollout's does). Slots
are interleaved round-robin (round r: every configuration once, the order rotated by r),
so background noise falls on all three. A slot: resume; `--lead` seconds of plain
decoding (the baseline, a few steps at least); the round; wait until every stream has a
token on the new version; `--tail` seconds; pause. A first warm-up round (the engines
allocate their receive buffers, kept for later rounds) is printed but left out of the table.
Engine cores and the trainer run `--threads` torch threads (1): on a small machine shared
with other work, two threads per engine oversubscribe the cores and a decode step of the
16 streams took seconds instead of ~0.4 s.

Per configuration: `round s`, p50 over rounds of the round from the first call to return
(paused: pause + send_weights + resume; in flight: send_weights), `send s` the same for
send_weights alone; `tok in rounds`, tokens the streams received during the rounds (all
rounds; paused: the outputs of the step in flight when the pause was called); `%base`,
the streams' token rate during the rounds against their rate in the lead before each
round; `vs none`, tokens over the active slots against the lead rate kept up throughout
(the same engine with no rounds at all; the engine process's RSS is printed at the end);
`tok/s`, tokens per second over the engine's active slots (lead + round + until every
stream switched + tail: it depends on this duty cycle, about `--lead` + `--tail`
seconds of plain decoding per round); `gap ms`, the median gap between consecutive
outputs of a stream in the leads; `stall ms`, the longest gap of any stream across the
switch (its last output on the old weights to its first on the new), p50 and max over
rounds, and that p50 over the median gap; `ctx`, the mean output length of the streams
at the switch; `stale`, streams whose first token after the switch is marked stale.

    python benchmarks/in_flight.py [--streams 16] [--rounds 6] [--lead 2] [--tail 1]
        [--device cuda --backend ipc]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hotswap import AsyncLLM, RequestOutputKind, SamplingParams
from hotswap.config import resolve_model_path
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
)

PROMPTS = [
    "The quick brown fox",
    "Reinforcement learning trains a policy",
    "Paged attention stores keys and values in blocks",
    "Write a long story about a lighthouse keeper",
    "Explain how a compiler turns source code into machine code",
    "The history of the printing press",
    "List the planets of the solar system and describe each",
    "A recipe for bread, step by step",
    "Why is the sky blue?",
    "Describe a walk through a forest in autumn",
    "The rules of chess, explained for a beginner",
    "How do vaccines work?",
    "A letter to a friend about a long journey",
    "The causes of the French Revolution",
    "Numbers 0123456789 and what they mean",
    "Summarize the plot of a detective novel",
]


@dataclass(frozen=True)
class Config:
    name: str
    in_flight: bool
    kv_policy: str
    double_buffer: bool = False

    def transfer_config(self, backend: str) -> dict[str, object]:
        return {"backend": backend, "in_flight": self.in_flight, "kv_policy": self.kv_policy,
                "double_buffer": self.double_buffer}  # fmt: skip


CONFIGS = {
    config.name: config
    for config in [
        Config("paused", in_flight=False, kv_policy="keep"),
        Config("keep", in_flight=True, kv_policy="keep"),
        Config("swap", in_flight=True, kv_policy="keep", double_buffer=True),
        Config("recompute", in_flight=True, kv_policy="recompute"),
    ]
}


@dataclass
class StreamLog:
    """One stream's outputs as received: arrival time, tokens in it, version of its last
    token, and whether that token is marked stale."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stale: list[bool] = field(default_factory=list)
    total: int = 0
    finished: bool = False

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in zip(self.times, self.tokens) if start <= t <= end)

    def gaps_between(self, start: float, end: float) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= a and b <= end]

    def first_on(self, version: int) -> int | None:
        return next((i for i, v in enumerate(self.versions) if v >= version), None)


@dataclass
class Slot:
    round: int
    round_s: float
    send_s: float
    lead_s: float
    active_s: float
    lead_tokens: int
    round_tokens: int
    active_tokens: int
    median_gap_s: float
    stall_s: float
    context: float
    stale_after: int  # streams whose first token on the new weights is marked stale


@dataclass
class Engine:
    config: Config
    llm: AsyncLLM
    trainer: object
    logs: list[StreamLog]
    tasks: list[asyncio.Task] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_trainer(path: Path, noise: float) -> tuple[torch.nn.Module, list[dict]]:
    """The trainer's model, and its two weight sets: [original, perturbed] (each tensor
    plus `noise` x its mean magnitude x standard normal noise)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    original = {n: p.detach().clone() for n, p in module.named_parameters()}
    perturbed = {
        n: t + noise * t.abs().mean() * torch.randn(t.shape, generator=gen)
        for n, t in original.items()
    }
    return module, [original, perturbed]


@torch.no_grad()
def set_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, param in module.named_parameters():
        param.copy_(weights[name])


async def start_engine(
    config: Config, path: Path, module: torch.nn.Module, args: argparse.Namespace
) -> Engine:
    llm = AsyncLLM(
        str(path),
        multiprocess=True,
        progress=False,
        dtype="float32",
        device=args.device,
        num_threads=args.threads,
        weight_transfer_config=config.transfer_config(args.backend),
    )
    await llm.get_weight_version()  # binds the engine to this event loop
    if args.backend == "ipc":
        info: object = IPCTrainerInitInfo(share_source=True)
    else:
        info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    client = InProcessWeightSyncClient(llm)
    trainer = await asyncio.to_thread(
        WeightTransferTrainerFactory.trainer_init, info, client, ModuleSource(module)
    )
    logs = [StreamLog() for _ in range(args.streams)]
    return Engine(config, llm, trainer, logs)


async def stream(llm: AsyncLLM, prompt: str, request_id: str, log: StreamLog, max_tokens: int):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    async for out in llm.generate(prompt, params, request_id=request_id):
        now = time.perf_counter()
        completion = out.outputs[0]
        if not completion.token_ids:
            continue
        span = completion.weight_versions[-1]
        log.times.append(now)
        log.tokens.append(len(completion.token_ids))
        log.versions.append(span.version)
        log.stale.append(span.stale)
        log.total += len(completion.token_ids)
        log.finished = out.finished


async def wait_until(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


async def run_slot(engine: Engine, r: int, args: argparse.Namespace) -> Slot:
    """Round r (0-based) on one engine; its weights become version r + 1."""
    llm, logs, version = engine.llm, engine.logs, r + 1
    if not engine.tasks:  # first slot: start the streams, let every one produce
        engine.tasks = [
            asyncio.ensure_future(
                stream(llm, PROMPTS[i % len(PROMPTS)], f"s{i}", log, args.max_tokens)
            )
            for i, log in enumerate(logs)
        ]
        await wait_until(lambda: min(g.total for g in logs) >= 4, 300, "the first tokens")
    else:
        await llm.resume_generation()
    lead_start = time.perf_counter()
    await asyncio.sleep(args.lead)
    await wait_until(  # a baseline of a few steps at least
        lambda: min(len(g.gaps_between(lead_start, time.perf_counter())) for g in logs) >= 2,
        300,
        "the lead's steps",
    )
    label = f"round-{r}"
    start = time.perf_counter()
    if engine.config.in_flight:
        send_start = time.perf_counter()
        await asyncio.to_thread(engine.trainer.send_weights, label)
        send_end = time.perf_counter()
    else:
        await llm.pause_generation(mode="keep", clear_cache=False)
        send_start = time.perf_counter()
        await asyncio.to_thread(engine.trainer.send_weights, label)
        send_end = time.perf_counter()
        await llm.resume_generation()
    end = time.perf_counter()
    await wait_until(
        lambda: all(g.versions and g.versions[-1] >= version for g in logs),
        300,
        f"every stream on version {version}",
    )
    await asyncio.sleep(args.tail)
    active_end = time.perf_counter()
    await llm.pause_generation(mode="keep", clear_cache=False)
    return measure(logs, r, version, lead_start, start, send_start, send_end, end, active_end)


def measure(
    logs: list[StreamLog],
    r: int,
    version: int,
    lead_start: float,
    start: float,
    send_start: float,
    send_end: float,
    end: float,
    active_end: float,
) -> Slot:
    gaps = [gap for g in logs for gap in g.gaps_between(lead_start, start)]
    stalls, contexts, stale = [], [], 0
    for g in logs:
        i = g.first_on(version)
        assert i is not None and i > 0, "a stream has no output before or after the switch"
        stalls.append(g.times[i] - g.times[i - 1])
        contexts.append(sum(g.tokens[:i]))
        stale += g.stale[i]
    return Slot(
        round=r,
        round_s=end - start,
        send_s=send_end - send_start,
        lead_s=start - lead_start,
        active_s=active_end - lead_start,
        lead_tokens=sum(g.tokens_between(lead_start, start) for g in logs),
        round_tokens=sum(g.tokens_between(start, end) for g in logs),
        active_tokens=sum(g.tokens_between(lead_start, active_end) for g in logs),
        median_gap_s=statistics.median(gaps),
        stall_s=max(stalls),
        context=statistics.mean(contexts),
        stale_after=stale,
    )


@dataclass
class Summary:
    name: str
    round_s: float
    send_s: float
    round_tokens: int
    base_pct: float
    vs_no_rounds: float
    tok_s: float
    gap_ms: float
    stall_ms: float
    stall_max_ms: float
    context: float
    stale: int
    streams: int

    @classmethod
    def of(cls, engine: Engine) -> Summary:
        slots = engine.slots
        # Tokens the streams would have received during the rounds at their lead rate.
        expected = sum(s.round_s * s.lead_tokens / s.lead_s for s in slots)
        stalls = [1000 * s.stall_s for s in slots]
        return cls(
            name=engine.config.name,
            round_s=statistics.median(s.round_s for s in slots),
            send_s=statistics.median(s.send_s for s in slots),
            round_tokens=sum(s.round_tokens for s in slots),
            base_pct=100 * sum(s.round_tokens for s in slots) / expected,
            # Tokens over the active slots against the lead rate kept up throughout: the
            # throughput of the same engine with no rounds at all.
            vs_no_rounds=sum(s.active_tokens for s in slots)
            / sum(s.active_s * s.lead_tokens / s.lead_s for s in slots),
            tok_s=sum(s.active_tokens for s in slots) / sum(s.active_s for s in slots),
            gap_ms=1000 * statistics.median(s.median_gap_s for s in slots),
            stall_ms=statistics.median(stalls),
            stall_max_ms=max(stalls),
            context=statistics.mean(s.context for s in slots),
            stale=sum(s.stale_after for s in slots),
            streams=len(engine.logs) * len(slots),
        )


def print_slot(engine: Engine, slot: Slot, warmup: bool) -> None:
    print(
        f"{'warm-up' if warmup else 'round':<7} {slot.round}  {engine.config.name:<10} "
        f"round {slot.round_s:6.2f} s  "
        f"send {slot.send_s:6.2f} s  tokens in round {slot.round_tokens:5d}  "
        f"lead {slot.lead_tokens / slot.lead_s:6.1f} tok/s  "
        f"stall {1000 * slot.stall_s:7.0f} ms  ctx {slot.context:5.0f}",
        flush=True,
    )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "inf (the paused rounds produced no token)"


def report(engines: list[Engine], args: argparse.Namespace, elapsed: float) -> None:
    rows = [Summary.of(e) for e in engines]
    print(
        f"\n{args.streams} streams, {args.rounds} rounds per configuration (after "
        f"{args.warmup_rounds} warm-up), lead {args.lead:g} s,"
        f" tail {args.tail:g} s; p50 over rounds unless noted\n"
    )
    print(f"{'config':<11}{'round s':>8}{'send s':>8}{'tok in rounds':>14}{'%base':>7}"
          f"{'vs none':>8}{'tok/s':>8}{'gap ms':>8}{'stall ms':>9}{'max':>7}{'stall/gap':>10}"
          f"{'ctx':>6}{'stale':>7}")  # fmt: skip
    for s in rows:
        print(
            f"{s.name:<11}{s.round_s:8.2f}{s.send_s:8.2f}{s.round_tokens:14d}{s.base_pct:6.0f}%"
            f"{s.vs_no_rounds:8.2f}{s.tok_s:8.1f}{s.gap_ms:8.1f}{s.stall_ms:9.0f}"
            f"{s.stall_max_ms:7.0f}{s.stall_ms / s.gap_ms:9.1f}x{s.context:6.0f}"
            f"{s.stale:4d}/{s.streams}"
        )
    paused = rows[0]  # the first configuration is the reference
    print()
    for s in rows[1:]:
        print(
            f"{s.name} vs paused: tokens during rounds {ratio(s.round_tokens, paused.round_tokens)}"
            f", throughput {ratio(s.tok_s, paused.tok_s)}, round time "
            f"{ratio(s.round_s, paused.round_s)}, stall at the switch "
            f"{ratio(s.stall_ms, paused.stall_ms)}"
        )
    lost = {s.name: 1 - s.vs_no_rounds for s in rows}
    for name in lost:
        if name != "paused" and "paused" in lost and lost[name] > 0:
            print(f"throughput lost to rounds: paused {lost['paused']:.1%}, {name} "
                  f"{lost[name]:.1%} ({lost['paused'] / lost[name]:.1f}x less)")  # fmt: skip
    print("vs none: tokens over the active slots against the lead rate kept up throughout")
    print("\nstale: streams whose first token after the switch is marked stale (KV kept)")
    print(f"total wall time {elapsed:.0f} s")


async def main(args: argparse.Namespace) -> None:
    begin = time.perf_counter()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    module, weight_sets = load_trainer(path, args.noise)
    module.to(args.device)  # on a GPU the ipc backend shares CUDA tensors (CUDA IPC)
    engines = []
    try:
        for name in args.configs:
            engines.append(await start_engine(CONFIGS[name], path, module, args))
        print(
            f"model {path.name} (float32), engines ready in {time.perf_counter() - begin:.0f} s;"
            f" {sum(p.numel() for p in module.parameters()) * 4 / 1e6:.0f} MB per round\n",
            flush=True,
        )
        for r in range(args.warmup_rounds + args.rounds):
            set_weights(module, weight_sets[(r + 1) % 2])  # perturbed, original, ...
            gc.collect()
            for k in range(len(engines)):
                engine = engines[(r + k) % len(engines)]
                slot = await run_slot(engine, r, args)
                if r >= args.warmup_rounds:
                    engine.slots.append(slot)
                print_slot(engine, slot, warmup=r < args.warmup_rounds)
        digests = {(await e.llm.get_weight_info())["digest"] for e in engines}
        versions = [(await e.llm.get_weight_version())["version"] for e in engines]
        finished = sum(g.finished for e in engines for g in e.logs)
        memory = {e.config.name: resident_mb(e.llm) for e in engines}
    finally:
        for engine in engines:
            for task in engine.tasks:
                task.cancel()
            await asyncio.gather(*engine.tasks, return_exceptions=True)
            engine.llm.shutdown()
    report(engines, args, time.perf_counter() - begin)
    print(
        f"engine weight versions after the run: {versions}; weights "
        f"{'identical' if len(digests) == 1 else 'DIFFERENT'} across the engines"
    )
    print(
        "engine process memory (RSS, MB): " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items())
    )
    if finished:
        print(f"WARNING: {finished} streams finished before the end: raise --max-tokens")


def resident_mb(llm: AsyncLLM) -> float:
    """The engine core process's resident memory."""
    pid = llm.client.process.pid  # type: ignore[attr-defined]
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per configuration")
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="rounds run first and left out of the table"
    )
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--lead", type=float, default=2.0, help="decoding before each round")
    parser.add_argument("--tail", type=float, default=1.0, help="decoding after the switch")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per engine core and in the trainer (this process)",
    )
    parser.add_argument("--noise", type=float, default=1e-3, help="relative perturbation")
    parser.add_argument("--backend", choices=["gloo", "ipc"], default="gloo")
    parser.add_argument("--device", default="cpu", help="the engines' and the trainer's")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=["paused", "keep", "swap"],
                        help="the first is the reference")  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
