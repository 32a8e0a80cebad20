"""`benchmarks/soak.py`: its checks catch what they claim to (fast), and a 96-cycle soak
with 32 streams against a real server loses nothing (slow)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.server import RemoteServer
from tests.reliability.conftest import ARGS

SOAK_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hotswap_soak", SOAK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _shared(soak: ModuleType):  # noqa: ANN202 - soak.Shared
    ledger = soak.Ledger(0, "default")
    ledger.issue("v1")
    return soak.Shared(soak.SoakConfig(), soak.Report(), ledger)


def _span(version: int, start: int, end: int, label: str | None = None) -> dict:
    label = label or ("default" if version == 0 else f"v{version}")
    return {"version": version, "label": label, "start": start, "end": end}


def _chunk(ids: int, spans: list[dict] | None) -> dict:
    return {"token_ids": list(range(ids)), "weight_versions": spans}


@pytest.mark.parametrize(
    ("chunks", "problem"),
    [
        ([_chunk(2, [_span(0, 0, 2)]), _chunk(1, [_span(1, 2, 3)])], None),
        ([_chunk(2, [_span(0, 0, 1), _span(1, 1, 2)]), _chunk(0, [])], None),
        ([_chunk(2, [_span(0, 0, 2)]), _chunk(1, [_span(0, 3, 4)])], "does not continue"),
        ([_chunk(3, [_span(0, 0, 2)])], "spans cover tokens up to 2"),
        ([_chunk(1, None)], "without weight_versions"),
        ([_chunk(1, [_span(1, 0, 1)]), _chunk(1, [_span(0, 1, 2)])], "version went down"),
        ([_chunk(1, [_span(2, 0, 1, "v2")])], "before its commit"),
        ([_chunk(1, [_span(1, 0, 1, "other")])], "before its commit"),
    ],
)
def test_stream_check_finds_provenance_errors(soak, chunks, problem) -> None:
    shared = _shared(soak)
    check = soak.StreamCheck(shared, "r")
    for chunk in chunks:
        check.chunk(chunk)
    if problem is None:
        assert shared.report.counts.total() == 0, shared.report.examples
    else:
        assert shared.report.counts.provenance == 1
        assert problem in shared.report.examples[0]


@pytest.mark.parametrize(
    ("finish", "tokens", "usage", "may_abort", "kind"),
    [
        ("length", 8, 8, False, None),
        ("abort", 3, 3, True, None),
        ("abort", 3, 3, False, "lost"),  # aborted, but no abort-mode pause ran
        ("length", 7, 7, False, "lost"),  # short of max_tokens
        (None, 8, 8, False, "lost"),  # no finish
        ("length", 8, 7, False, "provenance"),  # usage disagrees with what arrived
    ],
)
def test_judge_finds_lost_streams(soak, finish, tokens, usage, may_abort, kind) -> None:
    shared = _shared(soak)
    check = soak.StreamCheck(shared, "r")
    check.tokens = tokens
    outcome = soak.Outcome(finish_reason=finish, usage_tokens=usage, done=True)
    soak.judge("r", outcome, check, 8, may_abort, shared.report)
    counts = shared.report.counts
    assert counts.total() == (kind is not None)
    if kind is not None:
        assert getattr(counts, kind) == 1


def test_sse_lines_split_only_at_sse_line_ends(soak) -> None:
    """JSON may hold U+2028 or U+0085 unescaped; httpx's aiter_lines splits there."""

    class Response:
        async def aiter_bytes(self):  # noqa: ANN202
            for part in ('data: {"t": "a\u2028b\u0085', 'c"}\r', "\ndata: [DONE]\n\n"):
                yield part.encode()

    async def lines() -> list[str]:
        return [line async for line in soak.sse_lines(Response())]

    got = [line for line in asyncio.run(lines()) if line]
    assert got == ['data: {"t": "a\u2028b\u0085c"}', "data: [DONE]"]


@pytest.mark.slow
def test_soak_96_cycles_32_streams(soak, v1_dir: Path) -> None:
    """Every pause mode, with and without clearing the cache, relabels while paused and
    while running and a disk reload every 12 cycles: 0 lost, hung, 5xx, wrong states and
    provenance errors. About 45 s on 2 cores.

    96 cycles are 16 shuffled blocks of the 6 (mode, clear_cache) pairs, so each pair
    pauses 32 live streams 16 times, in random order against the streams' random gaps;
    every fourth cycle commits while generation runs, and 8 of the commits are disk
    reloads. A longer soak (benchmarks/soak.py, 1000 cycles by default) repeats the same
    transitions; this one covers each of them many times over in a quarter of the time."""
    cycles = 96
    config = soak.SoakConfig(
        cycles=cycles,
        streams=32,
        served_model_name="tiny",
        model_dir=str(v1_dir),
        reload_every=12,
        min_tokens=4,
        max_tokens=16,
        gap_s=(0.02, 0.1),
        hang_timeout_s=30.0,
        time_limit_s=240.0,
    )
    # One torch thread: the engine keeps a core, the 32 clients in this process the other
    # (two engine threads on two busy cores spin against the clients, for no faster steps).
    threads = ("--num-threads", "1")
    with RemoteServer(v1_dir, *ARGS, *threads, "--log-level", "warning") as server:
        report = asyncio.run(soak.soak(server.url, config))
        assert server.proc.poll() is None  # still serving
    print(soak.format_report(report, config))
    assert report.counts == soak.Counts(), soak.format_report(report, config)
    assert report.cycles_done == cycles and not report.timed_out
    # The checks had something to check: aborts, streams across commits, real reloads.
    assert report.aborted > 0 and report.multi_version > 0 and report.reloads == 8
    # Every (mode, clear_cache) pair paused the server once per block of 6 cycles.
    assert len(report.pause_s) == len(soak.MODES)
    assert all(len(pauses) == cycles // len(soak.MODES) for pauses in report.pause_s.values())
