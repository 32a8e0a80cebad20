"""Trainer-side LoRA: push a peft model's adapter (only its tensors, a few MB) into
rollout engines through any weight transfer backend, as that adapter's next version.

    trainer = WeightTransferTrainerFactory.trainer_init(info, client, adapter_source(peft))
    push_adapter(trainer, peft, "policy")        # after every optimizer step

The engine receives the tensors beside the served versions (generation goes on), checks
them against the adapter's shapes, and commits them all at once: new requests naming
"policy" run on the new version, running ones finish on theirs. peft is imported only by
the caller's model; nothing here imports it at module level.
"""

from __future__ import annotations

from typing import Any

import torch

from hotswap.weight_transfer.base import TensorSource
from hotswap.weight_transfer.clients import Committed
from hotswap.weight_transfer.trainer import TrainerWeightTransferEngine

# adapter_config.json keys the engine reads (the rest are training-only settings)
_CONFIG_KEYS = ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias",
                "use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern",
                "alpha_pattern", "target_parameters")  # fmt: skip


def adapter_tensors(
    peft_model: Any, adapter_name: str = "default"
) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors under PEFT's saved names (`base_model.model.model.layers.0.
    self_attn.q_proj.lora_A.weight`); they share storage with the live parameters, so a
    source built from them sends what the optimizer last wrote."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    return [(name, tensor.detach()) for name, tensor in state.items()]


def adapter_source(peft_model: Any, adapter_name: str = "default") -> TensorSource:
    return TensorSource(adapter_tensors(peft_model, adapter_name))


def adapter_config(peft_model: Any, adapter_name: str = "default") -> dict[str, Any]:
    """The adapter's config as adapter_config.json writes it (the keys the engine reads)."""
    config = peft_model.peft_config[adapter_name].to_dict()
    declared = {key: config[key] for key in _CONFIG_KEYS if key in config}
    for key in ("target_modules", "target_parameters"):  # peft may hold them as sets
        if isinstance(declared.get(key), (set, frozenset, list, tuple)):
            declared[key] = sorted(declared[key])
    peft_type = declared.get("peft_type")
    declared["peft_type"] = getattr(peft_type, "value", peft_type)
    return declared


def push_adapter(
    trainer: TrainerWeightTransferEngine,
    peft_model: Any,
    lora_name: str,
    weight_version: str | None = None,
    adapter_name: str = "default",
) -> Committed | None:
    """One round sending the adapter (the trainer's source: `adapter_source(peft_model)`)
    as `lora_name`'s next version, created on the engine if new; returns the commit
    (`lora_name`, `lora_version` in the engine's answer)."""
    config = adapter_config(peft_model, adapter_name)
    return trainer.send_weights(weight_version, lora_name=lora_name, lora_config=config)
