"""A worker extension as RL frameworks write them (verl, OpenRLHF, TRL): it joins the
trainer's torch.distributed group and loads each broadcast tensor with the model's own
`load_weights`. Loaded by `--worker-extension-cls tests.helpers.gloo_extension:GlooReceiver`."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class GlooReceiver:
    def init_group(self, host: str, port: int, world_size: int, rank: int) -> str:
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))  # fmt: skip
        self.group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=60))
        return f"joined as rank {rank} of {world_size}"

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """The trainer (rank 0) broadcasts each tensor in `names` order."""
        weights = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast(tensor, 0).wait()
            weights.append((name, tensor))
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    def close_group(self) -> None:
        self.group = None

    def rank_and_device(self) -> dict:
        return {"rank": self.rank, "device": str(self.device)}
