"""A trainer on the same machine pushes its weights into `hotswap serve` through named
shared memory (the `ipc` backend).

The server starts with random weights (`--load-format dummy`), so its first completion is
gibberish. The trainer (the real built-in SmolLM2-135M-Instruct, loaded with transformers)
moves its parameters into shared memory once, in place (`share_source=True`: the model
trains on as before), pauses generation and sends only JSON over HTTP (names, dtypes,
shapes, the segment's name and byte offsets; no pickle). The engine reads the weights
straight from the trainer's memory: one copy in all, at the commit. It resumes and the
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


def sync_weights(url: str) -> None:
    """The trainer's side of one update: a full round through shared memory."""
    model = load_trainer_model()
    info = IPCTrainerInitInfo(share_source=True)
    client = HTTPWeightSyncClient(url)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    sync_round(url, engine, model, "through shared memory")


def main() -> None:
    demo({"backend": "ipc"}, sync_weights)


if __name__ == "__main__":
    main()
