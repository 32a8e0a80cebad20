"""A trainer on the same machine pushes its weights into `hotswap serve` through named
shared memory (the `ipc` backend).

The server starts with random weights (`--load-format dummy`), so its first completion is
gibberish. The trainer (the real built-in SmolLM2-135M-Instruct, loaded with transformers)
pauses generation, writes its weights into shared-memory segments of at most 64 MiB
(packed mode: several tensors per segment, memory bounded), and for each segment sends only
JSON over HTTP (names, dtypes, shapes, the segment's name; no pickle). It resumes and the
same prompt completes sensibly. No group to join: the ipc engine needs no rendezvous.

    .venv/bin/python examples/rlhf_http_ipc.py
"""

from __future__ import annotations

from _rlhf_http import demo, load_trainer_model, sync_round

from hotswap.weight_transfer import (
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
)

SEGMENT_BYTES = 64 << 20


def sync_weights(url: str) -> None:
    """The trainer's side of one update: a full round through shared memory."""
    model = load_trainer_model()
    info = IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=SEGMENT_BYTES)
    client = HTTPWeightSyncClient(url)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    sync_round(url, engine, model, "through shared memory")


def main() -> None:
    demo({"backend": "ipc"}, sync_weights)


if __name__ == "__main__":
    main()
