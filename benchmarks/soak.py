"""Soak: N pause/resume cycles of mixed modes under M streaming clients, against a real
`hotswap serve` process on 127.0.0.1, with provenance checked on every token.

M clients keep streaming `/v1/completions` (`ignore_eos`, random lengths, `token_ids` and
`weight_versions` on every chunk) while a driver runs N cycles: pause (abort, wait or keep,
clear_cache true or false, in shuffled blocks so each gets N/6), commit a new weight
version while paused (an `/update_weight_version` relabel, or every `--reload-every`
cycles an `/update_weights_from_disk` reload of the model's own weights: a real commit),
resume; every fourth cycle also relabels once generation has resumed. Checked:

- lost: a stream that ends without a finish and `[DONE]`, breaks, is aborted with no
  abort-mode pause during its life, or finishes `length` short of `max_tokens`;
- hung: a stream or control call that sees nothing for `--hang-timeout` s, or a stream
  still open `--hang-timeout` s after the last cycle;
- 5xx: any answer >= 500;
- wrong-state: a control call refused or answering the wrong body, `/is_paused` wrong after
  pause or resume, `/weight_info` not naming the last commit, or a 4xx on a stream;
- provenance: per chunk, the `weight_versions` spans must cover exactly that chunk's new
  tokens (contiguous, absolute indexes, no gaps or overlaps); per stream, versions never
  decrease; every (version, label) must be one the driver had already issued (no version
  before its commit); the final usage must count the tokens received.

Prints the counts and pause p50/p99 per mode; exits 1 if any count is non-zero, 2 if the
`--time-limit` stopped it early. Everything is bounded: the run stops by itself.

    python benchmarks/soak.py [--model DIR] [--cycles 1000] [--streams 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODES = [(mode, clear) for mode in ("abort", "wait", "keep") for clear in (True, False)]
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours:",
    "In reinforcement learning, the policy",
    "Write a haiku about the sea.",
]
MAX_EXAMPLES = 20


@dataclass
class SoakConfig:
    cycles: int = 1000
    streams: int = 32
    served_model_name: str = "soak"
    model_dir: str | None = None  # reloaded from every `reload_every` cycles (None: never)
    reload_every: int = 50
    min_tokens: int = 8
    max_tokens: int = 48
    gap_s: tuple[float, float] = (0.05, 0.25)  # streams run this long between cycles
    # Must exceed the longest legitimate silence: a wait-mode pause lasts as long as the
    # longest request in flight (max_tokens steps), and a stream queued meanwhile hears
    # nothing until the resume. Default model, bf16 on a CPU without AMX: ~1 s a step.
    hang_timeout_s: float = 300.0
    time_limit_s: float = 7200.0
    seed: int = 0
    progress: bool = False  # a line on stderr every 100 cycles


@dataclass
class Counts:
    lost: int = 0
    hung: int = 0
    server_errors: int = 0  # 5xx
    wrong_state: int = 0
    provenance: int = 0

    def total(self) -> int:
        return sum(asdict(self).values())


@dataclass
class Report:
    counts: Counts = field(default_factory=Counts)
    cycles_done: int = 0
    requests: int = 0
    tokens: int = 0
    commits: int = 0
    reloads: int = 0
    aborted: int = 0  # streams an abort-mode pause ended (expected)
    multi_version: int = 0  # streams whose tokens span more than one version
    pause_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    resume_s: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)  # the first problems, for diagnosis
    elapsed_s: float = 0.0
    timed_out: bool = False

    def problem(self, kind: str, detail: str) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{kind}: {detail}")


class Ledger:
    """The commits the driver issued: version -> label. A version is issued before its
    request is sent, so a token may carry it as soon as the server commits it."""

    def __init__(self, version: int, label: str) -> None:
        self.labels = {version: label}
        self.version, self.label = version, label

    def issue(self, label: str) -> None:
        self.version += 1
        self.label = label
        self.labels[self.version] = label


@dataclass
class Shared:
    config: SoakConfig
    report: Report
    ledger: Ledger
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Abort-mode pauses called and returned so far: one called but not returned when a
    # stream began may abort it (its request can reach the engine first).
    aborts_called: int = 0
    aborts_returned: int = 0


class StreamCheck:
    """Provenance of one stream, chunk by chunk (spans index the whole output)."""

    def __init__(self, shared: Shared, request_id: str) -> None:
        self.shared, self.request_id = shared, request_id
        self.tokens = 0
        self.first_version = self.last_version = -1

    def chunk(self, choice: dict[str, Any]) -> None:
        problem = self._problem(choice.get("token_ids") or [], choice.get("weight_versions"))
        if problem:
            self.shared.report.problem("provenance", f"{self.request_id}: {problem}")
        self.tokens += len(choice.get("token_ids") or [])

    def _problem(self, ids: list[int], spans: list[dict[str, Any]] | None) -> str | None:
        if spans is None:
            return "chunk without weight_versions"
        position = self.tokens
        for span in spans:
            if span["start"] != position or span["end"] <= span["start"]:
                return f"span {span} does not continue at token {position}"
            version = span["version"]
            if version < self.last_version:
                return f"version went down: {self.last_version} -> {version}"
            if self.shared.ledger.labels.get(version) != span["label"]:
                return f"version {version} ({span['label']!r}) before its commit"
            if self.first_version == -1:
                self.first_version = version
            self.last_version, position = version, span["end"]
        if position != self.tokens + len(ids):
            return f"spans cover tokens up to {position}, chunk ends at {self.tokens + len(ids)}"
        return None


# -- streams ------------------------------------------------------------------------------
async def stream_worker(index: int, client: httpx.AsyncClient, shared: Shared) -> None:
    rng = random.Random(shared.config.seed * 1000 + index)
    serial = 0
    while not shared.stop.is_set():
        serial += 1
        await one_stream(f"s{index}-{serial}", client, shared, rng)


async def one_stream(
    request_id: str, client: httpx.AsyncClient, shared: Shared, rng: random.Random
) -> None:
    config, report = shared.config, shared.report
    max_tokens = rng.randint(config.min_tokens, config.max_tokens)
    body = {
        "model": config.served_model_name,
        "prompt": rng.choice(PROMPTS),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    check = StreamCheck(shared, request_id)
    aborts_returned = shared.aborts_returned
    report.requests += 1
    answered = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            answered = True
            if response.status_code != 200:
                await response.aread()
                kind = "server_errors" if response.status_code >= 500 else "wrong_state"
                report.problem(kind, f"{request_id}: HTTP {response.status_code} {response.text}")
                return
            outcome = await read_stream(response, check)
    except httpx.TimeoutException:
        report.problem("hung", f"{request_id}: nothing for {config.hang_timeout_s} s")
        return
    except (httpx.HTTPError, ValueError, KeyError) as e:
        where = f"after {check.tokens} tokens" if answered else "before the response"
        report.problem("lost", f"{request_id}: stream broke {where} ({e!r})")
        return
    report.tokens += check.tokens
    report.aborted += outcome.finish_reason == "abort"
    report.multi_version += check.first_version not in (-1, check.last_version)
    may_abort = shared.aborts_called > aborts_returned
    judge(request_id, outcome, check, max_tokens, may_abort, report)


@dataclass
class Outcome:
    finish_reason: str | None = None
    usage_tokens: int | None = None
    done: bool = False


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, split only where SSE ends a line (CR, LF). httpx's aiter_lines
    also splits at U+2028, U+0085 and others, which JSON strings may hold unescaped (a
    random tiny model does emit them)."""
    pending = b""
    async for data in response.aiter_bytes():
        lines = (pending + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line.decode()
    if pending:
        yield pending.decode()


async def read_stream(response: httpx.Response, check: StreamCheck) -> Outcome:
    outcome = Outcome()
    async for line in sse_lines(response):
        if line == "data: [DONE]":
            outcome.done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                check.chunk(choice)
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
            if chunk.get("usage"):
                outcome.usage_tokens = chunk["usage"]["completion_tokens"]
    return outcome


def judge(
    request_id: str, outcome: Outcome, check: StreamCheck, max_tokens: int, may_abort: bool,
    report: Report,
) -> None:  # fmt: skip
    if not outcome.done or outcome.finish_reason is None:
        report.problem("lost", f"{request_id}: ended without a finish ({outcome})")
    elif outcome.finish_reason == "abort" and not may_abort:
        report.problem("lost", f"{request_id}: aborted with no abort-mode pause")
    elif outcome.finish_reason not in ("abort", "length") or (
        outcome.finish_reason == "length" and check.tokens != max_tokens
    ):
        report.problem("lost", f"{request_id}: {outcome.finish_reason} after {check.tokens} of "
                               f"{max_tokens} tokens")  # fmt: skip
    elif outcome.usage_tokens != check.tokens:
        report.problem("provenance", f"{request_id}: usage says {outcome.usage_tokens} tokens, "
                                     f"{check.tokens} received")  # fmt: skip


# -- control ------------------------------------------------------------------------------
async def call(
    client: httpx.AsyncClient, report: Report, method: str, path: str, **kwargs: Any
) -> dict[str, Any] | None:
    """One control call; None (and the problem counted) unless it answered 200 JSON."""
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.TimeoutException:
        report.problem("hung", f"{method} {path}: no answer")
        return None
    except httpx.HTTPError as e:
        report.problem("wrong_state", f"{method} {path}: {e!r}")
        return None
    if response.status_code != 200:
        kind = "server_errors" if response.status_code >= 500 else "wrong_state"
        report.problem(kind, f"{method} {path}: HTTP {response.status_code} {response.text}")
        return None
    return response.json()


async def expect(
    client: httpx.AsyncClient, report: Report, method: str, path: str, want: dict[str, Any],
    **kwargs: Any,
) -> float:  # fmt: skip
    """Seconds the call took; a wrong answer is a wrong state."""
    start = time.perf_counter()
    body = await call(client, report, method, path, **kwargs)
    elapsed = time.perf_counter() - start
    if body is not None and any(body.get(k) != v for k, v in want.items()):
        report.problem("wrong_state", f"{method} {path}: {body}, expected {want}")
    return elapsed


async def commit(client: httpx.AsyncClient, shared: Shared, label: str, reload: bool) -> None:
    shared.ledger.issue(label)
    shared.report.commits += 1
    if reload:
        shared.report.reloads += 1
        body = {"model_path": shared.config.model_dir, "weight_version": label}
        want = {"success": True, "weight_version": label, "version": shared.ledger.version}
        await expect(client, shared.report, "POST", "/update_weights_from_disk", want, json=body)
    else:
        want = {"success": True, "new_version": label}
        body = {"new_version": label}
        await expect(client, shared.report, "POST", "/update_weight_version", want, json=body)


async def check_state(client: httpx.AsyncClient, shared: Shared, paused: bool) -> None:
    report = shared.report
    await expect(client, report, "GET", "/is_paused", {"is_paused": paused})
    if paused:
        return  # the weights are checked after the commit and resume
    info = await call(client, report, "GET", "/weight_info")
    ledger = shared.ledger
    if info is not None and (info.get("version"), info.get("weight_version")) != (
        ledger.version, ledger.label
    ):  # fmt: skip
        report.problem("wrong_state", f"/weight_info: {info}, expected version "
                                      f"{ledger.version} ({ledger.label!r})")  # fmt: skip


async def one_cycle(
    client: httpx.AsyncClient, shared: Shared, cycle: int, mode: str, clear: bool
) -> None:
    config, report = shared.config, shared.report
    params = {"mode": mode, "clear_cache": "true" if clear else "false"}
    shared.aborts_called += mode == "abort"
    elapsed = await expect(client, report, "POST", "/pause", {"status": "paused"}, params=params)
    shared.aborts_returned += mode == "abort"
    report.pause_s[f"{mode}, clear_cache={str(clear).lower()}"].append(elapsed)
    await check_state(client, shared, paused=True)
    reload = bool(config.model_dir and config.reload_every and cycle % config.reload_every == 0)
    await commit(client, shared, f"soak-{cycle}" + ("-reload" if reload else ""), reload)
    elapsed = await expect(client, report, "POST", "/resume", {"status": "resumed"})
    report.resume_s.append(elapsed)
    if cycle % 4 == 3:  # a commit while generation runs: versions change mid-stream
        await asyncio.sleep(0.02)
        await commit(client, shared, f"soak-{cycle}-running", reload=False)
    await check_state(client, shared, paused=False)


async def drive(client: httpx.AsyncClient, shared: Shared, deadline: float) -> None:
    rng = random.Random(shared.config.seed)
    block: list[tuple[str, bool]] = []
    for cycle in range(shared.config.cycles):
        if time.monotonic() > deadline:
            shared.report.timed_out = True
            return
        if not block:
            block = rng.sample(MODES, len(MODES))
        await asyncio.sleep(rng.uniform(*shared.config.gap_s))
        await one_cycle(client, shared, cycle, *block.pop())
        shared.report.cycles_done += 1
        if shared.config.progress and shared.report.cycles_done % 100 == 0:
            report = shared.report
            print(f"soak: {report.cycles_done} cycles, {report.requests} requests, problems: "
                  f"{report.counts}", file=sys.stderr, flush=True)  # fmt: skip


# -- the run ------------------------------------------------------------------------------
async def soak(url: str, config: SoakConfig) -> Report:
    """Runs the soak against the server at `url` (which nobody else drives)."""
    start = time.monotonic()
    report = Report()
    timeout = httpx.Timeout(config.hang_timeout_s, connect=10.0)
    # Idle connections are dropped well before the server's keep-alive timeout (uvicorn:
    # 5 s, httpx's default expiry too), so a request never races the server closing it.
    limits = httpx.Limits(max_connections=config.streams + 8, keepalive_expiry=2.0)
    async with (
        httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as streams,
        httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as control,
    ):
        info = await call(control, report, "GET", "/weight_info")
        if info is None:
            return report
        shared = Shared(config, report, Ledger(info["version"], info["weight_version"]))
        tasks = [
            asyncio.create_task(stream_worker(i, streams, shared)) for i in range(config.streams)
        ]
        try:
            await drive(control, shared, start + config.time_limit_s)
        finally:
            shared.stop.set()
            await finish(control, shared, tasks)
    report.elapsed_s = time.monotonic() - start
    return report


async def finish(client: httpx.AsyncClient, shared: Shared, tasks: list[asyncio.Task]) -> None:
    """Let every stream end by itself; one still open after the hang timeout is hung."""
    await call(client, shared.report, "POST", "/resume")  # never leave the server paused
    done, pending = await asyncio.wait(tasks, timeout=shared.config.hang_timeout_s)
    for task in pending:
        shared.report.problem("hung", "a stream was still open after the last cycle")
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            shared.report.problem("lost", f"a stream client failed: {task.exception()!r}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def format_report(report: Report, config: SoakConfig) -> str:
    c = report.counts
    lines = [
        f"soak: {report.cycles_done}/{config.cycles} cycles x {config.streams} streams in "
        f"{report.elapsed_s:.0f} s: {report.requests} requests, {report.tokens} tokens, "
        f"{report.commits} commits ({report.reloads} disk reloads); {report.aborted} streams "
        f"aborted by a pause, {report.multi_version} spanning several versions",
        f"lost {c.lost}  hung {c.hung}  5xx {c.server_errors}  wrong-state {c.wrong_state}  "
        f"provenance-errors {c.provenance}",
        f"{'pause (ms)':<32}{'n':>6}{'p50':>9}{'p99':>9}",
    ]
    rows = sorted(report.pause_s.items()) + [("resume", report.resume_s)]
    for name, values in rows:
        if values:
            p50, p99 = percentile(values, 0.5) * 1e3, percentile(values, 0.99) * 1e3
            lines.append(f"{name:<32}{len(values):>6}{p50:>9.1f}{p99:>9.1f}")
    if report.timed_out:
        lines.append(f"stopped early: --time-limit of {config.time_limit_s:.0f} s reached")
    lines += [f"  {e}" for e in report.examples]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: built-in)")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--reload-every", type=int, default=50, help="0: relabels only")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--hang-timeout", type=float, default=300.0, help="seconds of silence that count as hung"
    )
    parser.add_argument("--time-limit", type=float, default=7200.0, help="seconds, whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `hotswap serve` flag"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hotswap.config import resolve_model_path

    model_dir = resolve_model_path(args.model)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.server import RemoteServer

    config = SoakConfig(
        cycles=args.cycles,
        streams=args.streams,
        model_dir=str(model_dir),
        reload_every=args.reload_every,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        hang_timeout_s=args.hang_timeout,
        time_limit_s=args.time_limit,
        seed=args.seed,
        progress=True,
    )
    flags = ["--enable-control", "--served-model-name", config.served_model_name]
    server = RemoteServer(model_dir, *flags, "--log-level", "warning", *args.server_arg)
    try:
        report = asyncio.run(soak(server.url, config))
    finally:
        rc = server.stop()
    if rc != 0:
        report.problem("wrong_state", f"the server exited with {rc}")
    print(format_report(report, config))
    if report.counts.total():
        print("server log (tail):\n" + "".join(list(server.log)[-40:]))
        return 1
    return 2 if report.timed_out else 0


if __name__ == "__main__":
    sys.exit(main())
