"""Full weight-sync time over gloo through SGLang's distributed route vs vLLM's four-phase
route, against `hotswap serve` processes, on the same data.

- sglang: `/init_weights_update_group` once, then per update one
  `/update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache: false,
  weight_version} while the trainer posts one `dist.broadcast` per tensor, in `names`
  order and in its own dtype, and waits for them all: slime's sequence, driven exactly as
  tests/entrypoints/sglang/test_weights.py drives it (the trainer's group made
  with torch's process-group helpers under a group name, as slime, SGLang and AReaL do).
  Always unpacked: one broadcast per tensor.
- vllm packed / vllm unpacked: hotswap's trainer API (`GlooTrainerInitInfo`,
  `HTTPWeightSyncClient`, `WeightTransferTrainerFactory.trainer_init`) joins once, then
  per update `send_weights(label)`: /start_weight_update, /update_weights while the data
  moves (packed: tensors packed into 2 x 64 MiB rotating buffers; unpacked: one broadcast
  per tensor, as SGLang's), /finish_weight_update.

One server per path (`--dtype float32 --enable-control`, gloo weight transfer, a small KV
cache): an engine holds one transfer channel, so one server could take both routes only by
joining a new group at every switch, which neither framework does per update; with a
server each, every path keeps its group for the whole run, as a trainer does. The
servers start from the model's own weights. The trainer's tensors are the model's
safetensors (`safetensors.torch.load_file`, float32) and, alternately, their negation, so
every sync changes every weight: round r sends the negated set for even r, the original
for odd r, through every path, the order of the paths rotating from round to round. The
vLLM paths send them through a `TensorSource` over the same tensors.

Time per sync: from the first HTTP call of the update (sglang: the update call; vllm:
/start_weight_update) to the commit's answer (sglang: that call's answer, the broadcasts
done; vllm: /finish_weight_update's answer). After each sync /weight_info's digest and
label are checked (outside the timing): the original set must give the digest the servers
started with, the negated set the digest its first sync gave (different, and the same on
every path). `--warmup` untimed rounds come first. Prints median and min per path and the
speed ratio vllm-time / sglang-time (target: >= 0.95 against vllm packed, i.e. SGLang's
route is not slower).

    python benchmarks/weight_sync_dialects.py [--model DIR] [--rounds 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import socket
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed import distributed_c10d as c10d

from hotswap.config import resolve_model_path
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    TensorSource,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.server import RemoteServer  # noqa: E402

SERVER_ARGS = ("--served-model-name", "bench", "--dtype", "float32", "--enable-control",
               "--weight-transfer-config", '{"backend": "gloo"}', "--max-model-len", "512",
               "--num-kv-blocks", "64", "--log-level", "warning")  # fmt: skip
GROUP = "slime-pp_0"
Tensors = list[tuple[str, torch.Tensor]]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alongside(request: Callable[[], Any], trainer: Callable[[], Any]) -> tuple[Any, Any]:
    """(the HTTP answer, the trainer's result): the call is in flight while the trainer
    acts, as slime's Ray calls are."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(request)
        result = trainer()
        return future.result(timeout=600), result


# -- SGLang's route, the trainer's side as slime builds it --------------------------------
def torch_helper_group(port: int, world_size: int, name: str) -> dist.ProcessGroup:
    """Rank 0 of a gloo group made like SGLang's `init_custom_process_group` (slime's
    `init_process_group`): a tcp:// rendezvous, its store prefixed with the group name,
    then torch's own `_new_process_group_helper`."""
    timeout = datetime.timedelta(seconds=120)
    store, rank, size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size,
                                             timeout=timeout))  # fmt: skip
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        size, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store),
        group_name=name, backend_options=None, timeout=timeout,
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def broadcast_all(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """slime's data plane: every tensor posted as its own broadcast from rank 0, then all
    waited for."""
    works = [dist.broadcast(t, 0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


class SGLangPath:
    name = "sglang"

    def __init__(self, server: RemoteServer) -> None:
        self.http = server.client(timeout=600)
        port = free_port()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": GROUP, "backend": "gloo"}  # fmt: skip
        response, self.group = alongside(
            lambda: self.http.post("/init_weights_update_group", json=init),
            lambda: torch_helper_group(port, 2, GROUP),
        )
        check(response.status_code == 200 and response.json()["success"] is True, response.text)

    def sync(self, items: Tensors, label: str) -> float:
        payload = {  # as slime's SGLangEngine.update_weights_from_distributed builds it
            "names": [name for name, _ in items],
            "dtypes": [str(t.dtype).replace("torch.", "") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "group_name": GROUP,
            "flush_cache": False,
            "weight_version": label,
        }
        tensors = [t for _, t in items]
        start = time.perf_counter()
        response, _ = alongside(
            lambda: self.http.post("/update_weights_from_distributed", json=payload),
            lambda: broadcast_all(self.group, tensors),
        )
        seconds = time.perf_counter() - start
        check(response.status_code == 200, response.text)
        check(response.json()["weight_version"] == label, response.text)
        return seconds

    def weight_info(self) -> dict[str, Any]:
        return self.http.get("/weight_info").json()

    def close(self) -> None:
        dist.destroy_process_group(self.group)
        self.http.close()


# -- vLLM's four-phase route through hotswap's trainer API --------------------------------
class WindowClient(HTTPWeightSyncClient):
    """Records the window from /start_weight_update's call to /finish_weight_update's
    answer."""

    start = end = 0.0

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.start = time.perf_counter()
        super().start_weight_update(is_checkpoint_format)

    def finish_weight_update(self, *args: Any, **kwargs: Any) -> Any:
        committed = super().finish_weight_update(*args, **kwargs)
        self.end = time.perf_counter()
        return committed


class VLLMPath:
    def __init__(self, server: RemoteServer, packed: bool, items: Tensors) -> None:
        self.name = "vllm packed" if packed else "vllm unpacked"
        self.client = WindowClient(server.url)
        self.source = TensorSource(items)
        info = GlooTrainerInitInfo(master_port=free_port(), world_size=2, packed=packed)
        self.engine: TrainerWeightTransferEngine = WeightTransferTrainerFactory.trainer_init(
            info, self.client, self.source
        )

    def sync(self, items: Tensors, label: str) -> float:
        self.source.tensors = items
        committed = self.engine.send_weights(label)
        check(committed is not None and committed.label == label, repr(committed))
        return self.client.end - self.client.start

    def weight_info(self) -> dict[str, Any]:
        return self.client.weight_info()

    def close(self) -> None:
        self.engine.shutdown()
        self.client.close()


SyncPath = SGLangPath | VLLMPath


def check(ok: bool, detail: str) -> None:
    if not ok:
        raise RuntimeError(f"sanity check failed: {detail[:500]}")


def load_sets(model_dir: Path) -> dict[str, Tensors]:
    """The model's own tensors (float32, contiguous) and their negation."""
    files = sorted(model_dir.glob("*.safetensors"))
    original = [
        (name, t.to(torch.float32).contiguous()) for f in files for name, t in load_file(f).items()
    ]
    return {"original": original, "negated": [(name, -t) for name, t in original]}


def run(args: argparse.Namespace) -> None:
    model_dir = resolve_model_path(args.model)
    sets = load_sets(model_dir)
    nbytes = sum(t.nbytes for _, t in sets["original"])
    servers: list[RemoteServer] = []
    paths: list[SyncPath] = []
    try:
        for make in (
            lambda s: SGLangPath(s),
            lambda s: VLLMPath(s, True, sets["original"]),
            lambda s: VLLMPath(s, False, sets["original"]),
        ):
            servers.append(RemoteServer(model_dir, *SERVER_ARGS))
            paths.append(make(servers[-1]))
        expected: dict[str, str] = {}
        for path in paths:
            digest = path.weight_info()["digest"]
            check(expected.setdefault("original", digest) == digest,
                  f"{path.name}: starting digest differs")  # fmt: skip
        times: dict[str, list[float]] = {path.name: [] for path in paths}
        for r in range(args.warmup + args.rounds):
            which = "negated" if r % 2 == 0 else "original"
            for k in range(len(paths)):
                path = paths[(r + k) % len(paths)]
                label = f"r{r}-{path.name.replace(' ', '-')}"
                seconds = path.sync(sets[which], label)
                info = path.weight_info()
                want = expected.setdefault(which, info["digest"])
                check(info["digest"] == want and info["weight_version"] == label,
                      f"{path.name}, round {r} ({which}): {info}")  # fmt: skip
                if r >= args.warmup:
                    times[path.name].append(seconds)
            gc.collect()
        check(expected["negated"] != expected["original"], "the negated set changed nothing")
    finally:
        for path in paths:
            path.close()
        for server in servers:
            server.stop()
    report(args, model_dir, len(sets["original"]), nbytes, times)


def report(args: argparse.Namespace, model_dir: Path, count: int, nbytes: int, times: dict) -> None:
    print(f"model {model_dir.name}: {count} tensors, {nbytes / 1e6:.0f} MB float32; gloo over "
          f"loopback; {args.rounds} timed rounds per path (after {args.warmup} warm-up), "
          f"paths interleaved; one server per path")  # fmt: skip
    print(f"{'path':<15}{'broadcasts':>11}{'median s':>10}{'min s':>8}{'GB/s (med)':>12}")
    for name, values in times.items():
        sends = "per tensor" if name != "vllm packed" else "64 MiB bufs"
        median = statistics.median(values)
        print(f"{name:<15}{sends:>11}{median:>10.3f}{min(values):>8.3f}"
              f"{nbytes / median / 1e9:>12.2f}")  # fmt: skip
    print("all digests as expected after every sync")
    sglang = times["sglang"]
    for other in ("vllm packed", "vllm unpacked"):
        med = statistics.median(times[other]) / statistics.median(sglang)
        best = min(times[other]) / min(sglang)
        target = "  (target >= 0.95)" if other == "vllm packed" else ""
        print(f"speed sglang vs {other}: {other}-time / sglang-time = {med:.3f} (median), "
              f"{best:.3f} (min){target}")  # fmt: skip
    for name, values in times.items():
        print(f"{name}: " + " ".join(f"{v:.3f}" for v in values))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--rounds", type=int, default=5, help="timed syncs per path")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    return parser.parse_args()


if __name__ == "__main__":
    run(parse_args())
