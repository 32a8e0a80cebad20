"""RL-side helpers: driving several rollout engines as one; pushing a LoRA adapter;
pushing a sharded trainer's shards into a tensor-parallel engine."""

from hotswap.rl.engine_group import EngineGroup, EngineGroupError, GroupCommittedWeights
from hotswap.rl.lora import adapter_config, adapter_source, adapter_tensors, push_adapter
from hotswap.rl.sharded import sharded_sender

__all__ = [
    "EngineGroup",
    "EngineGroupError",
    "GroupCommittedWeights",
    "adapter_config",
    "adapter_source",
    "adapter_tensors",
    "push_adapter",
    "sharded_sender",
]
