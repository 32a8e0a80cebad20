"""Full weight-sync time and bandwidth per backend, next to this machine's memcpy bandwidth.

For two models, a trainer-side transformers model sends every weight (float32) into an
in-process `LLM(..., weight_transfer_config={"backend": b}, dtype="float32")` that starts
from random weights, through `InProcessWeightSyncClient`; best of `--rounds` rounds:

- many-small: a llama with 224 layers of hidden size 128, 103 MB in 2019 tensors: 1568
  matrices of 128 x 128 (16K elements, 64 KiB), 448 norm vectors, embeddings and head;
  per-tensor overhead counts;
- default: the built-in SmolLM2-135M-Instruct (272 tensors, 538 MB).

Backends: gloo packed (2 x 64 MiB rotating buffers) and unpacked (one broadcast per tensor),
ipc unpacked (one staging segment), packed (64 MiB staging segments) and shared (the trainer's
parameters live in shared memory and are sent in place), disk (safetensors).

`total` is what a trainer sees: `send_weights()` from call to return (source check, start,
data plane, the engine's validation and staging, finish = all-or-nothing apply).
`xfer` leaves out the control calls `start` and `finish` (the apply), so it is the data
plane plus the engine's receive-side validation and staging. GB/s counts the bytes sent
once; memcpy is `torch.Tensor.copy_` of a 256 MiB float32 tensor into memory already
touched, bytes copied once (%memcpy is against it); the copy into freshly allocated memory
is printed too, since every round stages into new tensors.

    python benchmarks/weight_sync.py [--rounds 3] [--layers 224]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotswap import LLM
from hotswap.default_model import default_model_dir
from hotswap.weight_transfer import (
    DiskTrainerInitInfo,
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

MIB = 1 << 20
BUFFER_BYTES = 64 * MIB


@dataclass(frozen=True)
class Case:
    backend: str
    mode: str
    make_info: Callable[[Path], TrainerInitInfo]


CASES = [
    Case("gloo", "packed", lambda _: GlooTrainerInitInfo(master_port=free_port(), world_size=2)),
    Case(
        "gloo",
        "unpacked",
        lambda _: GlooTrainerInitInfo(master_port=free_port(), world_size=2, packed=False),
    ),
    Case("ipc", "unpacked", lambda _: IPCTrainerInitInfo()),
    Case(
        "ipc",
        "packed",
        lambda _: IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=BUFFER_BYTES),
    ),
    Case("disk", "-", lambda tmp: DiskTrainerInitInfo(directory=str(tmp / "disk"))),
    # Last: it moves the trainer's parameters into shared memory for good.
    Case("ipc", "shared", lambda _: IPCTrainerInitInfo(share_source=True)),
]


@dataclass
class Result:
    case: Case
    model: str
    total_s: float
    xfer_s: float
    nbytes: int
    digest: str | None


class ControlTimer:
    """Client mixin: records how long the engine spends in the start and finish (apply)
    calls."""

    control_s = 0.0

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        start = time.perf_counter()
        super().start_weight_update(is_checkpoint_format)  # type: ignore[misc]
        self.control_s += time.perf_counter() - start

    def finish_weight_update(self, weight_version: str | None = None, abort: bool = False) -> Any:
        start = time.perf_counter()
        committed = super().finish_weight_update(weight_version, abort)  # type: ignore[misc]
        self.control_s += time.perf_counter() - start
        return committed


class TimedInProcessClient(ControlTimer, InProcessWeightSyncClient):
    def digest(self) -> str:
        return self.llm.get_weight_info()["digest"]


class TimedHTTPClient(ControlTimer, HTTPWeightSyncClient):
    def digest(self) -> str:
        return self.weight_info()["digest"]


TimedClient = TimedInProcessClient | TimedHTTPClient


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memcpy_gbps(nbytes: int = 256 * MIB, repeats: int = 5) -> tuple[float, float]:
    """(into memory already touched, into freshly allocated memory: page faults included)."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    warm = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    fresh = min(_timed(lambda: torch.empty_like(src).copy_(src)) for _ in range(repeats))
    return nbytes / warm / 1e9, nbytes / fresh / 1e9


def gloo_loopback_gbps(nbytes: int = 64 * MIB, repeats: int = 3) -> float:
    """Raw gloo broadcast bandwidth between two threads of this process over loopback TCP:
    the ceiling for the gloo backends on this machine."""
    import threading

    from hotswap.weight_transfer.broadcast import join_group

    port, groups = free_port(), {}
    buffers = {rank: torch.ones(nbytes, dtype=torch.uint8) for rank in (0, 1)}

    def both(fn: Callable[[int], Any]) -> None:
        threads = [threading.Thread(target=fn, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    both(
        lambda r: groups.__setitem__(
            r, join_group("127.0.0.1", port, r, 2, torch.device("cpu"), 60)
        )
    )
    best = min(
        _timed(lambda: both(lambda r: groups[r].broadcast(buffers[r], 0).wait()))
        for _ in range(repeats)
    )
    groups.clear()
    gc.collect()
    return nbytes / best / 1e9


@contextlib.contextmanager
def receiver(
    path: Path, backend: str, engine: str, weight_dir: Path | None = None
) -> Iterator[TimedClient]:
    """The engine that receives (random starting weights, a small KV cache): an `LLM` in
    this process, or a `hotswap serve` process driven over HTTP (what an RL trainer runs).
    `weight_dir`: where the disk backend's files are (allowed_weight_dirs)."""
    settings = dict(dtype="float32", load_format="dummy", num_kv_blocks=64, max_model_len=512)
    allowed = [str(weight_dir)] if weight_dir is not None else None
    if engine == "in-process":
        config = {"backend": backend}
        llm = LLM(
            str(path),
            progress=False,
            weight_transfer_config=config,
            allowed_weight_dirs=allowed,
            **settings,
        )
        yield TimedInProcessClient(llm)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.server import RemoteServer

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    config = f'--weight-transfer-config={{"backend": "{backend}"}}'
    if allowed:
        flags += ["--allowed-weight-dirs", *allowed]
    server = RemoteServer(path, *flags, config, "--enable-control")
    client = TimedHTTPClient(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def run_sparse(path: Path, trainer: torch.nn.Module, args: argparse.Namespace) -> float:
    """Best seconds to send patches changing `density` of every tensor's elements."""
    with receiver(path, "sparse", args.engine) as client:
        return _sparse_rounds(client, trainer, args.rounds, args.density)


def _sparse_rounds(
    client: TimedClient, trainer: torch.nn.Module, rounds: int, density: float
) -> float:
    from hotswap.weight_transfer import SparseTrainerInitInfo, diff_patches

    info = SparseTrainerInitInfo(master_port=free_port(), world_size=2)
    engine = WeightTransferTrainerFactory.trainer_init(info, client, None)
    gen = torch.Generator().manual_seed(0)
    before = {name: p.detach() for name, p in trainer.named_parameters()}
    after = {
        name: torch.where(torch.rand(t.shape, generator=gen) < density, t + 1.0, t)
        for name, t in before.items()
    }
    patches = diff_patches(before, after)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        engine.send_patches(patches, "sparse")
        times.append(time.perf_counter() - start)
    return min(times)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1: the tokenizer trainer prints blank lines from native code."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def many_small_model(tmp: Path, layers: int) -> Path:
    """A llama whose every matrix is 128 x 128 (16K elements): 7 of them per layer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.tiny_models import write_tiny_model

    sizes = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4)
    with quiet_stdout():
        return write_tiny_model(
            tmp / "many_small", "llama", 0, num_hidden_layers=layers, num_key_value_heads=4, **sizes
        )


def load_trainer(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def run_case(
    case: Case, model_name: str, path: Path, trainer: torch.nn.Module, tmp: Path, args
) -> Result:
    source = ModuleSource(trainer)
    with receiver(path, case.backend, args.engine, tmp) as client:
        engine = WeightTransferTrainerFactory.trainer_init(case.make_info(tmp), client, source)
        total_s, xfer_s = best_of(engine, client, args.rounds)
        digest = client.digest()
        engine.shutdown()
    gc.collect()
    nbytes = sum(m.nbytes for m in source.metadata())
    return Result(case, model_name, total_s, xfer_s, nbytes, digest)


def best_of(
    engine: TrainerWeightTransferEngine, client: TimedClient, rounds: int
) -> tuple[float, float]:
    """Best (total, xfer) seconds over `rounds` full syncs."""
    best_total, best_xfer = float("inf"), float("inf")
    for i in range(rounds):
        client.control_s = 0.0
        total = _timed(lambda i=i: engine.send_weights(f"round-{i}"))
        best_total, best_xfer = min(best_total, total), min(best_xfer, total - client.control_s)
    return best_total, best_xfer


def print_table(results: list[Result], memcpy: float) -> None:
    print(f"{'backend':<8}{'mode':<10}{'model':<12}{'MB':>7}{'total s':>9}{'GB/s':>7}"
          f"{'%memcpy':>9}{'xfer s':>8}{'GB/s':>7}{'%memcpy':>9}")  # fmt: skip
    for r in results:
        total_gbps, xfer_gbps = r.nbytes / r.total_s / 1e9, r.nbytes / r.xfer_s / 1e9
        print(
            f"{r.case.backend:<8}{r.case.mode:<10}{r.model:<12}{r.nbytes / 1e6:>7.0f}"
            f"{r.total_s:>9.3f}{total_gbps:>7.2f}{100 * total_gbps / memcpy:>8.1f}%"
            f"{r.xfer_s:>8.3f}{xfer_gbps:>7.2f}{100 * xfer_gbps / memcpy:>8.1f}%"
        )


def find(results: list[Result], backend: str, mode: str, model: str) -> Result:
    return next(
        r for r in results if (r.case.backend, r.case.mode, r.model) == (backend, mode, model)
    )


def print_targets(results: list[Result], memcpy: float) -> None:
    def pct(r: Result, seconds: float) -> float:
        return 100 * r.nbytes / seconds / 1e9 / memcpy

    packed = find(results, "gloo", "packed", "many-small")
    unpacked = find(results, "gloo", "unpacked", "many-small")
    print(f"\ngloo packed / unpacked on many-small: {unpacked.total_s / packed.total_s:.2f}x "
          f"(total), {unpacked.xfer_s / packed.xfer_s:.2f}x (xfer); target >= 3x")  # fmt: skip
    for r in results:
        target = {"ipc": 50, "gloo": 25}.get(r.case.backend)
        if target is not None and (r.case.backend, r.case.mode) != ("gloo", "unpacked"):
            name = f"{r.case.backend} {r.case.mode} on {r.model}"
            print(f"{name}: {pct(r, r.total_s):.1f}% of memcpy (total), "
                  f"{pct(r, r.xfer_s):.1f}% (xfer); target >= {target}%")  # fmt: skip


def check_digests(results: list[Result]) -> None:
    for model in dict.fromkeys(r.model for r in results):
        digests = {r.digest for r in results if r.model == model}
        verdict = "identical" if len(digests) == 1 else f"DIFFERENT ({len(digests)} digests)"
        print(f"engine weights after the last round, {model}: {verdict} across backends")


def main(args: argparse.Namespace) -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="hotswap-bench-") as tmp_name:
        tmp = Path(tmp_name)
        models = {"many-small": many_small_model(tmp, args.layers), "default": default_model_dir()}
        memcpy, fresh = memcpy_gbps()
        print(f"memcpy (torch copy_, 256 MiB fp32, {torch.get_num_threads()} threads): "
              f"{memcpy:.2f} GB/s (into freshly allocated memory: {fresh:.2f} GB/s); "
              f"best of {args.rounds} rounds per row; receiving engine: "
              f"{args.engine}\n")  # fmt: skip
        gloo_raw = gloo_loopback_gbps()
        share = 100 * gloo_raw / memcpy
        print(f"raw gloo broadcast over loopback (64 MiB, two threads): {gloo_raw:.2f} GB/s = "
              f"{share:.1f}% of memcpy: the ceiling for gloo here\n")  # fmt: skip
        results, sparse_s = [], 0.0
        for name, path in models.items():
            trainer = load_trainer(path)
            for case in CASES:
                results.append(run_case(case, name, path, trainer, tmp, args))
            if name == "default":
                sparse_s = run_sparse(path, trainer, args)
            del trainer
            gc.collect()
    print_table(results, memcpy)
    print_targets(results, memcpy)
    full = find(results, "gloo", "packed", "default")
    print(
        f"sparse at {100 * args.density:g}% density on default: {sparse_s:.3f} s, "
        f"{full.total_s / sparse_s:.1f}x faster than a full gloo packed sync; target >= 20x"
    )
    check_digests(results)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--density", type=float, default=0.01, help="sparse: changed fraction")
    parser.add_argument("--layers", type=int, default=224, help="many-small model's layers")
    parser.add_argument(
        "--engine",
        choices=["in-process", "server"],
        default="in-process",
        help="receiving engine: an LLM in this process, or `hotswap serve` over HTTP",
    )
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
