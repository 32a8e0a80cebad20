"""Where a model's weights live while the engine sleeps: offloaded to a host backup
(sleep level 1) or discarded (level 2), and brought back on wake."""

from __future__ import annotations

import torch
from torch import nn


class WeightResidency:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.backup: dict[str, torch.Tensor] = {}
        self.layout: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self.resident = True

    def offload(self, keep: bool = True) -> None:
        """Move every parameter into the host backup (or drop it: `keep=False`); the model
        keeps empty tensors, so a step that ran by mistake would fail loudly instead of
        using stale memory. An FP8 layer's reference weight (Fp8Config.keep_reference) is
        no parameter and stays resident: exact again after a level-1 wake; after a level-2
        one a complete round or a reload rewrites it with the codes."""
        if not self.resident:
            return
        for name, param in self.model.named_parameters():
            self.layout[name] = (param.shape, param.dtype, param.device)
            if keep:
                self.backup[name] = param.data.to("cpu") if param.is_cuda else param.data
            param.data = _placeholder(param)
        self.resident = False

    def discard(self) -> None:
        self.backup.clear()
        self.offload(keep=False)

    def restore(self) -> bool:
        """Bring the weights back. True if they are the pre-sleep weights; False if they
        were discarded: the parameters are then zero and must be loaded again."""
        if self.resident:
            return True
        params = dict(self.model.named_parameters())
        intact = bool(self.backup)
        for name, (shape, dtype, device) in self.layout.items():
            if intact:
                params[name].data = self.backup[name].to(device)
            else:
                params[name].data = torch.zeros(shape, dtype=dtype, device=device)
        self.backup.clear()
        self.resident = True
        return intact


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)
