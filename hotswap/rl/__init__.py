"""RL-side helpers: driving several rollout engines as one; pushing a LoRA adapter."""

from hotswap.rl.engine_group import EngineGroup, EngineGroupError, GroupCommittedWeights
from hotswap.rl.lora import adapter_config, adapter_source, adapter_tensors, push_adapter

__all__ = [
    "EngineGroup",
    "EngineGroupError",
    "GroupCommittedWeights",
    "adapter_config",
    "adapter_source",
    "adapter_tensors",
    "push_adapter",
]
