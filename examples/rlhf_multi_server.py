"""One trainer, several rollout servers, one commit: `hotswap.rl.EngineGroup`.

Two `hotswap serve` processes start with random weights: one plain, one with two
data-parallel engine cores (`--data-parallel-size 2`), so three engine workers in all. The
trainer (the real built-in SmolLM2-135M-Instruct, loaded with transformers) joins one gloo
group with all three (world size 4), pauses both servers, sends its weights once, and the
group commits them in two phases: every engine checks the round first, then all commit
(had any refused, none would have). Both servers then answer sensibly, and report the same
weight version and digest.

    .venv/bin/python examples/rlhf_multi_server.py
"""

from __future__ import annotations

from _rlhf_http import PROMPT, complete, control, free_port, load_trainer_model, serve

from hotswap.rl import EngineGroup
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

CONFIG = {"backend": "gloo", "require_complete": True}


def main() -> None:
    with serve(CONFIG) as (name, plain), serve(CONFIG, ["--data-parallel-size", "2"]) as (_, dp):
        urls = [plain, dp]
        for url in urls:
            print(f"{url} (random weights): {PROMPT!r} -> {complete(url, name)[0]!r}")
        group = EngineGroup([HTTPWeightSyncClient(url) for url in urls])
        print(f"engine workers per server: {group.world_sizes} -> gloo world size "
              f"{1 + group.num_workers}")  # fmt: skip
        info = GlooTrainerInitInfo(master_port=free_port(), world_size=1 + group.num_workers)
        sync = WeightTransferTrainerFactory.trainer_init(
            info, client=group, source=ModuleSource(load_trainer_model())
        )
        for url in urls:
            control(url, "POST", "/pause?mode=keep")
        sync.send_weights("step-1")
        for url in urls:
            control(url, "POST", "/resume")
        print(f"every server now has: {group.check_consistent()}")
        for url in urls:
            text, spans = complete(url, name)
            print(f"{url} (trained weights): {PROMPT!r} -> {text!r}\n  weight_versions: {spans}")
        sync.shutdown()
        group.close()


if __name__ == "__main__":
    main()
