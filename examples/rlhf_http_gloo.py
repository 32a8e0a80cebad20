"""A trainer pushes its weights into a running `hotswap serve` over a gloo broadcast.

The server starts with random weights (`--load-format dummy`), so its first completion is
gibberish. A trainer-side model (the real built-in SmolLM2-135M-Instruct, loaded with
transformers) then joins a gloo group with the server's engine, pauses generation the way an
RL loop does, broadcasts every weight, resumes, and the same prompt completes sensibly.
Control calls go over HTTP; the tensors go over gloo (packed into rotating 64 MiB buffers).

    .venv/bin/python examples/rlhf_http_gloo.py
"""

from __future__ import annotations

from _rlhf_http import control, demo, free_port, load_trainer_model, sync_round

from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)


def sync_weights(url: str) -> None:
    """The trainer's side of one update: join the group once, then send a full round."""
    model = load_trainer_model()
    workers = control(url, "GET", "/get_world_size")["world_size"]
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=workers + 1)
    client = HTTPWeightSyncClient(url)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    sync_round(url, engine, model, "over gloo")


def main() -> None:
    demo({"backend": "gloo"}, sync_weights)


if __name__ == "__main__":
    main()
