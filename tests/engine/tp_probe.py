"""A worker extension for the tensor-parallel tests: what each rank holds, and a whole
checkpoint loaded by each rank's own code (as verl's and OpenRLHF's extensions load the
tensors a trainer broadcast to every worker). Loaded by
`worker_extension_cls="tests.engine.tp_probe:ShardProbe"`."""

from __future__ import annotations

from typing import Any

from safetensors.torch import load_file


class ShardProbe:
    def share(self) -> dict[str, Any]:
        model = self.model_runner.model  # type: ignore[attr-defined]  # set by the engine
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        return {"rank": self.rank, "qkv_rows": qkv.shape[0]}  # type: ignore[attr-defined]

    def load_checkpoint(self, path: str) -> int:
        """Every tensor of `path`, whole: the model keeps this rank's slices."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return len(model.load_weights(load_file(f"{path}/model.safetensors").items()))

    def fail_on(self, rank: int) -> None:
        if self.rank == rank:  # type: ignore[attr-defined]
            raise ValueError(f"refused on rank {rank}")
