"""An adapter being received in a weight round: its PEFT tensors, staged apart from the
served versions, with the interface a round writes through (the one the decoder models
give a round: `checkpoint_view`, `expected_checkpoint_keys`, `expand_keys`, `parameter_index`,
`load_weights`). Only at the commit do they become a new adapter version."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hotswap.errors import InvalidArgument
from hotswap.lora.adapter import TARGETS, AdapterConfig, AdapterWeights, canonical_name
from hotswap.lora.experts import expected_expert_tensors

_BLOCKS = {t: ("self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp")
           for t in TARGETS}  # fmt: skip


class AdapterStage:
    """`base`: the version the round starts from (None: a new adapter, which the round
    must send whole). Tensors are float32: the commit builds the version from them."""

    def __init__(self, name: str, config: AdapterConfig, base: AdapterWeights | None,
                 model: Any) -> None:  # fmt: skip
        self.name, self.config, self.base = name, config, base
        self.tensors = _expected_tensors(config, base, model)

    @property
    def complete_required(self) -> bool:
        return self.base is None

    def checkpoint_view(self, name: str) -> tuple[str, torch.Tensor]:
        key = canonical_name(name)
        if key not in self.tensors:
            raise ValueError(f"weights: {name!r} is not a tensor of adapter {self.name!r} "
                             f"(r = {self.config.rank}, targets {self._targets()})")  # fmt: skip
        return key, self.tensors[key]

    def expected_checkpoint_keys(self) -> set[str]:
        return set(self.tensors)

    def expand_keys(self, keys: set[str]) -> set[str]:
        return keys  # an adapter's tensors are never stacked

    def parameter_index(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.tensors.items()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            key, dest = self.checkpoint_view(name)
            dest.copy_(tensor)
            loaded.add(key)
        return loaded

    def _targets(self) -> str:
        return ", ".join(sorted({k.split(".")[-3] for k in self.tensors}))


def _expected_tensors(config: AdapterConfig, base: AdapterWeights | None,
                      model: Any) -> dict[str, torch.Tensor]:  # fmt: skip
    """Every tensor of the adapter, float32: the base version's, or zeros for a new one
    (whose modules come from its declared target_modules)."""
    if base is not None:
        return {key: tensor.detach().float().clone() for key, tensor in base.raw.items()}
    if not isinstance(config.target_modules, tuple):  # () with only target_parameters
        raise InvalidArgument(
            "lora_config.target_modules",
            "lora_config.target_modules: a new adapter sent by a weight round must list its "
            f"modules (one of {', '.join(TARGETS)}), not a pattern",
        )
    tensors = expected_expert_tensors(config, model)
    for layer in range(model.spec.num_layers):
        for target in config.target_modules:
            module = f"model.layers.{layer}.{_BLOCKS[target]}.{target}"
            # whole: a tensor-parallel rank's weight is a slice of it
            out_features, in_features = model.checkpoint_shape(f"{module}.weight")
            rank = config.rank_of(module)
            tensors[f"{module}.lora_A.weight"] = torch.zeros(rank, in_features)
            tensors[f"{module}.lora_B.weight"] = torch.zeros(out_features, rank)
    return tensors
