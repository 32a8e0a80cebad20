"""RL-side helpers: driving several rollout engines as one."""

from hotswap.rl.engine_group import EngineGroup, EngineGroupError, GroupCommittedWeights

__all__ = ["EngineGroup", "EngineGroupError", "GroupCommittedWeights"]
