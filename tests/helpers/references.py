"""What tests of FP8 layers' reference weights (--enable-bf16-logprobs, Fp8Config's
keep_reference) compare: the checkpoint's values, and what each tensor-parallel rank holds."""

from __future__ import annotations

import hashlib

import torch

from hotswap.model.reference import fp8_layers


def stacked_checkpoint(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The checkpoint's value of engine parameter `name` (an FP8 layer's codes): its
    checkpoint tensors as the engine fuses them (q/k/v and gate/up rows one after the
    other, each routed expert's matrices stacked), from the checkpoint alone."""
    layer, _, kind = name.rpartition(".")
    if layer.endswith(".mlp.experts"):
        experts = sorted({int(n.split(".")[-3]) for n in weights if n.startswith(layer + ".")})
        if kind == "down_proj":
            return torch.stack([weights[f"{layer}.{e}.down_proj.weight"] for e in experts])
        gate_up = [[weights[f"{layer}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]
                   for e in experts]  # fmt: skip
        return torch.stack([torch.cat(pair) for pair in gate_up])
    owner, _, module = layer.rpartition(".")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    names = parts.get(module, (module,))
    return torch.cat([weights[f"{owner}.{p}.{kind}"] for p in names])


def tensor_hash(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


class ReferenceProbe:
    """A worker extension (`worker_extension_cls="tests.helpers.references:ReferenceProbe"`):
    what each tensor-parallel rank holds."""

    def reference_hashes(self) -> dict[str, str]:
        """Each FP8 layer's reference on this rank, by its codes' parameter name."""
        model = self.model_runner.model  # type: ignore[attr-defined]  # set by the engine
        return {name: tensor_hash(layer.fp8.reference) for name, layer in fp8_layers(model)}

    def parameter_hashes(self, names: list[str]) -> dict[str, str]:
        """Parameters `names` on this rank (a bf16 engine's weights)."""
        params = dict(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        return {name: tensor_hash(params[name]) for name in names}
