"""One trainer actor, two engine actors, one commit: hotswap on Ray.

A local Ray cluster (2 CPUs) runs two `EngineActor`s with random weights of the built-in
SmolLM2-135M-Instruct shape, and a trainer actor holding the real model (loaded with
transformers). The trainer sends its weights once through Ray's object store (the `ray`
backend) to both engines; `RayEngineGroup` commits in two phases: every engine checks the
round first (prepare), then all commit (had any refused, none would have). Both engines
then answer sensibly and report the same weight version and digest.

    .venv/bin/python examples/rlhf_ray.py

On a cluster: `ray start --head` on one machine, `ray start --address=HEAD:6379` on the
others, then run this with `ray.init(address="auto")`.
"""

from __future__ import annotations

import ray
import torch

from hotswap import SamplingParams
from hotswap.ray import RayEngineGroup, RayTrainerInitInfo, launch_engines

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@ray.remote(num_cpus=1)
class Trainer:
    """Stands in for an RL trainer: holds the policy and pushes it to the engines."""

    def __init__(self, engines: list, names: list[str]) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        from hotswap.default_model import default_model_dir
        from hotswap.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
        self.group = RayEngineGroup(engines, names=names)
        self.sync = WeightTransferTrainerFactory.trainer_init(
            RayTrainerInitInfo(), client=self.group, source=ModuleSource(model)
        )

    def push(self, version: str) -> dict:
        committed = self.sync.send_weights(version, digest=True)
        return {"label": committed.label, "versions": [e.version for e in committed.engines]}

    def check(self) -> dict:
        return self.group.check_consistent()


def show(group: RayEngineGroup, when: str) -> None:
    outputs = group.generate([PROMPT, PROMPT], GREEDY)
    for name, output in zip(group.names, outputs):
        completion = output.outputs[0]
        print(f"{name} ({when}): {PROMPT!r} -> {completion.text!r}  "
              f"versions {sorted(set(completion.token_versions))}")  # fmt: skip


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Random weights, so the "before" answers are gibberish; half a CPU and one thread each.
    engines = launch_engines(
        2, engine_args={"load_format": "dummy", "dtype": "float32"}, num_cpus_per_engine=0.5
    )
    engines_only = RayEngineGroup(engines)
    show(engines_only, "random weights")
    trainer = Trainer.remote(engines.handles, engines.names)
    print(f"committed: {ray.get(trainer.push.remote('step-1'))}")
    print(f"every engine now has: {ray.get(trainer.check.remote())}")
    show(engines_only, "trained weights")
    engines.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
