"""`python -m tests.exactness`: run the differential exactness checker (see __init__)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # engines run eagerly, as in the tests


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '1h' -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 60s, 5m)")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    from tests.exactness.planted import PLANTS

    parser = argparse.ArgumentParser(prog="python -m tests.exactness", description=__doc__)
    parser.add_argument("--seed", type=int, default=0, help="the schedules' random seed")
    parser.add_argument(
        "--budget",
        type=parse_duration,
        default=60.0,
        help="time to spend checking, per transport (e.g. 60s, 5m)",
    )
    parser.add_argument(
        "--schedules", type=int, default=None, help="stop after this many schedules per transport"
    )
    parser.add_argument(
        "--transport",
        choices=("python", "http", "both"),
        default="python",
        help="the Python API (AsyncLLM), the HTTP server, or both",
    )
    parser.add_argument(
        "--shrink-budget",
        type=parse_duration,
        default=120.0,
        help="time to spend shrinking a failing schedule",
    )
    parser.add_argument(
        "--replay",
        metavar="JSON",
        help="play this schedule (as printed after 'replay:', or @FILE) once",
    )
    parser.add_argument(
        "--plant",
        choices=sorted(PLANTS),
        help="break hotswap in this process first (Python API only)",
    )
    parser.add_argument("--quiet", action="store_true", help="no line per schedule")
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    from tests.exactness.planted import planted
    from tests.exactness.runner import Budget, Checker, run
    from tests.exactness.weights import WeightBank

    transports = ("python", "http") if args.transport == "both" else (args.transport,)
    failed = False
    with (
        tempfile.TemporaryDirectory(prefix="hotswap-exactness-") as root,
        contextlib.ExitStack() as stack,
    ):
        if args.plant:
            stack.enter_context(planted(args.plant))
        bank = WeightBank(Path(root))
        for transport in transports:
            checker = Checker(bank, transport)
            try:
                if args.replay:
                    failed |= _replay(checker, args.replay)
                    continue
                show = None if args.quiet else (lambda line: print(line, flush=True))
                budget = Budget(args.budget, args.schedules)
                report = run(checker, args.seed, budget, args.shrink_budget, show)
                print(report.summary(), flush=True)
                failed |= report.found is not None
            finally:
                checker.close()
    return 1 if failed else 0


def _replay(checker, text: str) -> bool:  # noqa: ANN001 - a runner.Checker
    """Play one schedule (JSON, or @FILE holding it) and print the verdict; True if it failed."""
    from tests.exactness.runner import replay
    from tests.exactness.schedule import Schedule

    text = Path(text[1:]).read_text() if text.startswith("@") else text
    failures, tally = replay(checker, Schedule.from_json(text))
    verdict = "FAILED" if failures else "passed"
    print(
        f"replay ({checker.transport}): {verdict}; {tally.tokens} tokens checked, "
        f"{tally.expert_rows} routed-expert rows, {tally.stale} stale tokens"
    )
    for failure in failures:
        print(f"  {failure.kind}: {failure.message}")
    return bool(failures)


if __name__ == "__main__":
    sys.exit(main())
