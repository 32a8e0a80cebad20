"""A trainer pushes its weights into a running `hotswap serve` over a gloo broadcast.

The server starts with random weights (`--load-format dummy`), so its first completion is
gibberish. A trainer-side model (the real built-in SmolLM2-135M-Instruct, loaded with
transformers) then joins a gloo group with the server's engine, pauses generation the way an
RL loop does, broadcasts every weight, resumes, and the same prompt completes sensibly.
Control calls go over HTTP; the tensors go over gloo (packed into rotating 64 MiB buffers).

    .venv/bin/python examples/rlhf_http_gloo.py
"""

from __future__ import annotations

import time

from _rlhf_http import PROMPT, complete, control, free_port, load_trainer_model, serve

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
    print(f"pause: {control(url, 'POST', '/pause?mode=keep')}")
    start = time.perf_counter()
    engine.send_weights("real-weights")
    print(f"sent {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters over gloo "
          f"in {time.perf_counter() - start:.2f} s")  # fmt: skip
    print(f"resume: {control(url, 'POST', '/resume')}")
    engine.shutdown()
    client.close()


def main() -> None:
    with serve({"backend": "gloo"}) as (name, url):
        print(f"server: {name} at {url}")
        print(f"weight_info before: {control(url, 'GET', '/weight_info')}")
        text, spans = complete(url, name)
        print(f"random weights: {PROMPT!r} -> {text!r}\n  weight_versions: {spans}")
        sync_weights(url)
        print(f"weight_info after:  {control(url, 'GET', '/weight_info')}")
        text, spans = complete(url, name)
        print(f"real weights:   {PROMPT!r} -> {text!r}\n  weight_versions: {spans}")


if __name__ == "__main__":
    main()
